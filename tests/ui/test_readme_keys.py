"""The README's keys are the bindings: the step viewer's keys table and the server view's keys line name
exactly the keys the screens bind (keys.py, the drivers' own keys, the panes'), written as help writes them."""

from __future__ import annotations

import re
from pathlib import Path

from kvtui.drivers.chat import ChatDriver
from kvtui.drivers.program import ProgramDriver
from kvtui.drivers.trace import TraceDriver
from kvtui.keys import APP_KEYS, SERVER_KEYS, key_label
from kvtui.widgets.step.diagnostics_pane import DiagnosticsPane
from kvtui.widgets.step.token_buffer import TokenBufferPane
from kvtui.widgets.step.topk_pane import TopKPane

README = Path(__file__).resolve().parents[2] / "README.md"


def labels(bindings) -> set[str]:
    return {key_label(key) for binding in bindings for key in binding.key.split(",")}


def table_keys(section: str) -> set[str]:
    """Every key the first column of the table under `section` names: `F2` … `F6` is F2, F3, F4, F5, F6."""
    text = README.read_text()
    body = text[text.index(section) :]
    rows = re.findall(r"^\| (.+?) \| .+ \|$", body[: body.index("\n\n", body.index("| key |"))], re.M)
    found: set[str] = set()
    for cell in rows[2:] if rows[0] == "key" else rows[1:]:
        cell = re.sub(r"\([^)]*\)", "", cell)  # "(in the input)", "(or Enter in top-k)", "(watch)"
        for span in re.findall(r"`F(\d+)` … `F(\d+)`", cell):
            found |= {f"F{n}" for n in range(int(span[0]), int(span[1]) + 1)}
        cell = re.sub(r"`F\d+` … `F\d+`", "", cell)
        for word in re.split(r"\s*(?:/|,)\s*", cell):
            word = word.strip().strip("`").strip()
            if word:
                found.add(word)
    return found


def test_the_keys_table_names_every_key_the_step_viewer_binds_and_no_other():
    bound = labels(APP_KEYS) | labels(ChatDriver.BINDINGS) | labels(ProgramDriver.BINDINGS)
    bound |= labels(TraceDriver.BINDINGS) | labels(DiagnosticsPane.BINDINGS)
    documented = table_keys("### Keys")
    assert bound - documented == set(), f"bound but not in the README's keys table: {sorted(bound - documented)}"
    # a documented key is bound by the screen, a source or a pane (top-k's f, the cache pane's arrows)
    panes = labels(TopKPane.BINDINGS) | labels(TokenBufferPane.BINDINGS)
    assert documented - bound - panes == set(), f"in the README, bound nowhere: {sorted(documented - bound - panes)}"


def test_the_server_view_keys_line_names_its_keys():
    text = README.read_text()
    line = text[text.index("Keys: arrows / enter in the tree") :]
    line = line[: line.index("\n\n")]
    named = set(re.findall(r"`([^`]+)`", line))
    shown = {key_label(key) for binding in SERVER_KEYS if binding.show for key in binding.key.split(",")}
    assert shown - named == set(), f"the server view binds {sorted(shown - named)}; the README does not say so"

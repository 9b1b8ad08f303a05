"""Silent cache bugs users report, each named at the program's line with one alarm per cause: a forward with
`use_cache=False` that still writes into the cache it was handed, and a `crop`/`reset` that changed nothing
although the program asked for fewer tokens. Each corpus program runs watched through the real CLI (as a user
runs it); the transparency suite runs the same programs plain vs watched. What the installed transformers does
is feature-tested (program_headers), so the expectations hold on 4.57 and 5.x alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from plain_python import run_kvtui
from transformers import DynamicCache

from kvtui.engine.reading.silent_rules import check_edit_changed_nothing
from kvtui.engine.records.diagnostic_groups import group_diagnostics
from kvtui.engine.records.snapshot import Diagnostic
from kvtui.engine.watch.probe import watch
from program_headers import (
    crop_zero_empties_the_cache,
    expected_codes,
    header,
    model_dir,
    use_cache_false_leaves_the_cache,
)

ROOT = Path(__file__).resolve().parents[3]
CORPUS = ROOT / "tests" / "watch_corpus"


def watched_alarms(program: Path, tmp_path) -> list[Diagnostic]:
    """Every alarm of one watched run of `program` (`kvtui watch --headless --trace`), read from its trace."""
    trace = tmp_path / "run.jsonl"
    directory = str(model_dir(header(program, "kvtui-model")))
    command = ["watch", "--headless", "--trace", str(trace), str(program)]
    result = run_kvtui(*command, directory, cwd=ROOT)  # a pre-imported Python (tests/plain_python.py)
    assert result.returncode == 0, result.stderr[-3000:]
    found = []
    for record in map(json.loads, trace.read_text().splitlines()):
        if record["type"] == "step":
            found += [Diagnostic(d["code"], d["severity"], d["message"], record["step"]) for d in record["diagnostics"]]
        elif record["type"] == "diagnostic":
            found.append(Diagnostic(record["code"], record["severity"], record["message"], record["step"]))
    return found


def line_of(program: Path, text: str) -> str:
    """`tests/watch_corpus/PROG.py:N`, N the first line of the program holding `text`."""
    lines = program.read_text().splitlines()
    return f"tests/watch_corpus/{program.name}:{next(i for i, line in enumerate(lines, 1) if text in line)}"


# ---- class 1: use_cache=False writes into the cache it was passed ----------------------------------------


def test_a_look_ahead_scored_with_use_cache_false_is_named_where_it_writes(tmp_path):
    program = CORPUS / "lookahead_use_cache_false.py"
    found = watched_alarms(program, tmp_path)
    assert {d.code for d in found} == expected_codes(program)
    if use_cache_false_leaves_the_cache():  # a transformers that fixed it: the program is quiet
        assert found == []
        return
    # 5.24 writes the three scored tokens at each of the three look-aheads: one cause, one group
    at = line_of(program, "use_cache=False).logits")
    assert len(found) == 3 and all(d.severity == "warning" and f"[{at}]" in d.message for d in found)
    assert len({d.message for d in found}) == 3  # each says its own forward's count and lengths
    assert "wrote 3 token(s) into DynamicCache#1 (16 -> 19)" in found[0].message
    assert [g.count for g in group_diagnostics(found)] == [3]


def test_use_cache_unset_where_the_config_turns_it_off_is_named_too(tiny_model):
    model, tokenizer = tiny_model("llama")
    model.config.use_cache = False
    try:
        with watch(model, tokenizer) as watcher:
            cache = DynamicCache()
            with torch.inference_mode():
                model(input_ids=torch.tensor([[5, 6, 7, 8]]), past_key_values=cache, use_cache=True)
                model(input_ids=torch.tensor([[9, 10]]), past_key_values=cache)  # the config decides
                model(input_ids=torch.tensor([[11]]), past_key_values=cache, use_cache=True)  # asked: quiet
    finally:
        model.config.use_cache = True
    found = [d for d in watcher.diagnostics if d.code == "cache-written-without-use-cache"]
    if use_cache_false_leaves_the_cache():
        assert found == []
        return
    assert len(found) == 1, watcher.diagnostics
    assert "use_cache unset (the model's config says False) wrote 2 token(s)" in found[0].message
    assert "(4 -> 6)" in found[0].message and "test_silent_cache_rules.py:" in found[0].message


# ---- class 2: a crop or reset that changed nothing although the program asked for fewer tokens ----------


def test_crop_zero_as_a_reset_is_named_at_the_crop(tmp_path):
    program = CORPUS / "crop_zero_reset.py"
    found = watched_alarms(program, tmp_path)
    assert {d.code for d in found} == expected_codes(program)
    at = line_of(program, "cache.crop(0)  #")
    if crop_zero_empties_the_cache():  # 4.x: crop(0) keeps 0 tokens, the reset the program meant (said, info)
        assert all(d.code == "cache-edited" and d.severity == "info" and f"[{at}]" in d.message for d in found)
        return
    # 5.x: the two crops on a filled cache change nothing (named at the crop, one group), and each following
    # generate() continues the old text (stale-cache at the generate line: the consequence, one group)
    nothing = [d for d in found if d.code == "edit-changed-nothing"]
    stale = [d for d in found if d.code == "stale-cache"]
    assert len(nothing) == 2 and all(f"DynamicCache#1.crop(0) at [{at}] kept all" in d.message for d in nothing)
    assert "kept all 13 tokens" in nothing[0].message and "crop(-13)" in nothing[0].message
    assert len({d.message for d in nothing}) == 2 and len({d.message for d in stale}) == 2
    assert all(f"[{line_of(program, 'model.generate(')}]" in d.message for d in stale)
    assert [(g.code, g.count) for g in group_diagnostics(found)] == [("edit-changed-nothing", 2), ("stale-cache", 2)]


@pytest.mark.parametrize(
    "method,argument,before,after,said",
    [
        ("crop", 0, 13, 13, "kept all 13 tokens: crop's argument is the number of tokens to remove"),
        ("crop", 20, 13, 13, "kept all 13 tokens: it asked to keep 20, no fewer than it holds"),  # 4.x
        ("crop", 13, 13, 13, "it asked to keep 13, no fewer than it holds"),  # 4.x
        ("reset", None, 9, 9, "left 9 of 9 tokens"),
        ("crop", -2, 13, 11, None),  # did what it was asked
        ("crop", 5, 13, 5, None),  # 4.x: kept 5
        ("crop", 0, 0, 0, None),  # an empty cache: nothing to change
        ("reset", None, 9, 0, None),
        ("reorder_cache", None, 9, 9, None),  # not an edit that asks for fewer tokens
    ],
)
def test_the_rule_for_edits_that_changed_nothing(method, argument, before, after, said):
    """The rule alone, for what this transformers cannot reproduce (4.x's crop(n), a reset that leaves tokens)."""
    found = check_edit_changed_nothing(3, f"StaticCache#1.{method}(…) at [p.py:7]", method, argument, before, after)
    if said is None:
        assert found == []
    else:
        assert [(d.code, d.severity, d.step) for d in found] == [("edit-changed-nothing", "warning", 3)]
        assert found[0].message.startswith("StaticCache#1.") and said in found[0].message

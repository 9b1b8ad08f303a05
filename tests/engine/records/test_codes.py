"""One rulebook: every code any producer can emit (kvtui's chat, a watched program or tree, a packed batch, a
server's prefix cache) is registered (records/codes.py) and documented in the README's Diagnostics table with its
severity rule; a Diagnostic with any other code cannot be built; a renamed code's old traces still read."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kvtui.engine.records.codec import from_record
from kvtui.engine.records.codes import CODES, RENAMED, check_code
from kvtui.engine.records.snapshot import SEVERITIES, Diagnostic, Where

ROOT = Path(__file__).resolve().parents[3]
ENGINE = ROOT / "kvtui" / "engine"
# the calls that take a code as their first argument: the constructor, a state-like rule's transition, the chat's
# rewind note
CODE_CALLS = {"Diagnostic", "transition", "_note_rewind"}
# every part that produces alarms, and one code each is known to emit (the walk must see them)
PRODUCERS = {
    "reading/diagnostics.py": "double-bos",  # the step rules: kvtui's chat and watched programs
    "reading/silent_rules.py": "mask-length",  # silent cache bugs of watched programs
    "reading/verify.py": "cache-mismatch",
    "chat/edits.py": "state-rewind",  # kvtui's own chat
    "chat/render.py": "template-drift",
    "chat/session.py": "static-capacity",
    "watch/cache_edits.py": "cache-edited",  # watched programs: edits between forwards
    "watch/evictions.py": "cache-evicted",  # compressed caches
    "reading/evictions.py": "cache-evicted",  # a press's eviction in words, kvtui's chat (--press) and watched programs
    "batching/checks.py": "request-requeued",  # a packed batch
    "server/rules.py": "varying-start",  # a server's prefix cache
}


def emitted_codes() -> dict[str, set[str]]:
    """Every string literal passed as a code to a CODE_CALLS call in the engine, per module (and the literals a
    code variable is assigned from, as in `code = "recomputed-prefix"`)."""
    found: dict[str, set[str]] = {}
    for path in ENGINE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        here = found.setdefault(path.relative_to(ENGINE).as_posix(), set())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name not in CODE_CALLS:
                    continue
                arg = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "code"), None)
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    here.add(arg.value)
            elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "code" for t in node.targets):
                for value in ast.walk(node.value):
                    if isinstance(value, ast.Constant) and isinstance(value.value, str) and "-" in value.value:
                        here.add(value.value)
    return found


def readme_rows() -> dict[str, str]:
    """code -> its severity cell, from the README's Diagnostics table."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("### Diagnostics") :]
    table = table[: table.index("\n\n", table.index("| code | severity |"))]
    return {m[1]: m[2] for m in re.finditer(r"^\| `([a-z-]+)` \| ([^|]+) \|", table, re.M)}


def test_every_producer_emits_only_registered_codes():
    found = emitted_codes()
    for module, code in PRODUCERS.items():
        assert code in found[module], (module, found[module])  # the walk sees each producer
    every = set().union(*found.values())
    assert every - set(CODES) == set(), "codes emitted but not registered in records/codes.py"
    assert "prefix-miss" not in every  # renamed: recomputed-prefix (RENAMED maps old traces)
    # every registered code has a producer in the engine (a code nothing emits is a stale row)
    assert set(CODES) - every == set(), set(CODES) - every


def test_every_registered_code_is_documented_with_its_severity_rule():
    rows = readme_rows()
    assert set(CODES) - set(rows) == set(), "registered codes without a README Diagnostics row"
    assert set(rows) - set(CODES) == set(), "README rows for codes that are not registered"
    for name, code in CODES.items():
        assert set(code.severities) <= set(SEVERITIES)
        for severity in code.severities:
            assert severity in rows[name], (name, rows[name])  # the README's severity cell names each


def test_a_diagnostic_cannot_carry_an_unregistered_code_or_a_severity_its_rule_forbids():
    with pytest.raises(ValueError, match="unregistered alarm code 'made-up'"):
        Diagnostic("made-up", "warning", "m", 1)
    with pytest.raises(ValueError, match="never 'info'"):
        Diagnostic("cursor-mismatch", "info", "m", 1)
    check_code("static-capacity", "warning")
    check_code("static-capacity", "error")
    assert RENAMED["prefix-miss"] in CODES


def test_a_renamed_code_reads_from_old_traces_as_the_code_that_says_it_now():
    old = {"type": "diagnostic", "step": 3, "code": "prefix-miss", "severity": "warning", "message": "m"}
    assert from_record(Diagnostic, old) == Diagnostic("recomputed-prefix", "warning", "m", 3)
    where = {"origin": "a", "chain": 2, "position": 7, "block": "b"}
    note = from_record(Diagnostic, {**old, "where": where})
    assert note.where == Where("a", 2, 7, "b")


def test_server_notes_group_and_flood_as_every_alarm_does():
    """A server's notes go through the same grouping (per code and publisher) and the same flood bound."""
    from kvtui.engine.records.diagnostic_groups import FLOOD_LISTED, FloodGate, group_diagnostics

    notes = [Diagnostic("recomputed-prefix", "warning", f"miss {i}", i, Where("a:1", 1, i)) for i in range(3)]
    notes.append(Diagnostic("recomputed-prefix", "warning", "miss on b", 4, Where("b:2", 2, 0)))
    groups = group_diagnostics(notes)
    assert [(g.code, g.cache, g.count) for g in groups] == [
        ("recomputed-prefix", "a:1", 3),
        ("recomputed-prefix", "b:2", 1),
    ]
    gate = FloodGate()
    listed = [gate.admit(Diagnostic("cache-churn", "warning", "m", i)) for i in range(1, 130)]
    kept = [d for d in listed if d is not None]
    assert len(kept) == FLOOD_LISTED + 3 and gate.counts == {"cache-churn": 129}  # 20, then at 32, 64, 128
    assert kept[-1].message.startswith("128 cache-churn notes so far")


def test_an_old_server_traces_prefix_miss_notes_read_as_recomputed_prefix(tmp_path):
    import json

    from kvtui.engine.server.server_trace import HEADER, load_server_trace

    path = tmp_path / "old.jsonl"
    note = {"type": "note", "code": "prefix-miss", "severity": "warning", "message": "m", "batch": 1, "origin": "a"}
    path.write_text(json.dumps({"type": HEADER, "schema": 1}) + "\n" + json.dumps(note) + "\n")
    run = load_server_trace(path)
    assert [n["code"] for n in run.recorded_notes] == ["recomputed-prefix"]


def test_a_trace_line_with_an_unregistered_code_is_a_clear_error(tmp_path):
    from kvtui.engine.records.replay import Replay
    from kvtui.engine.records.trace import TraceError, read_trace

    sample = ROOT / "samples" / "seed-conversation.trace.jsonl"
    bad = tmp_path / "bad.jsonl"
    line = '{"type": "diagnostic", "step": 1, "code": "made-up", "severity": "warning", "message": "m"}\n'
    bad.write_text(sample.read_text() + line)
    with pytest.raises(TraceError, match="unregistered alarm code 'made-up'"):
        Replay(read_trace(bad))
    assert Replay(read_trace(sample)).snapshots  # the sample itself reads

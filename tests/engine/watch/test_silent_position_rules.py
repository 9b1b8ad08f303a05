"""Silent cache bugs users report where the positions or the mask a program derives disagree with the cache
it continues (issue 37, classes 3 and 7), each named at the program's line with one alarm per cause: a mask
that grows faster than the cache, and a loop that reads its cache length from a sliding layer. Each corpus
program runs watched through the real CLI; the transparency suite runs the same programs plain vs watched.
Both bugs are silent alike on 4.57 and 5.x (measured): no feature test decides here."""

from __future__ import annotations

import json
from pathlib import Path

from plain_python import run_kvtui

from kvtui.engine.reading.silent_rules import check_mask_length, positions_stuck_at_window
from kvtui.engine.records.diagnostic_groups import group_diagnostics
from kvtui.engine.records.snapshot import Diagnostic
from program_headers import expected_codes, header, model_dir

ROOT = Path(__file__).resolve().parents[3]
CORPUS = ROOT / "tests" / "watch_corpus"


def watched_alarms(program: Path, tmp_path) -> list[Diagnostic]:
    """Every alarm of one watched run of `program`, read from its trace (exit 1: an error-level alarm fired,
    `--fail-on error` being the default)."""
    return watched_run(program, tmp_path)[0]


def watched_run(program: Path, tmp_path) -> tuple[list[Diagnostic], str]:
    """One watched run of `program`: its alarms (as watched_alarms) and what the program printed."""
    trace = tmp_path / "run.jsonl"
    directory = str(model_dir(header(program, "kvtui-model")))
    command = ["watch", "--headless", "--trace", str(trace), str(program)]
    result = run_kvtui(*command, directory, cwd=ROOT)  # a pre-imported Python (tests/plain_python.py)
    assert result.returncode in (0, 1) and "program exit code 0" in result.stderr, result.stderr[-3000:]
    found = []
    for record in map(json.loads, trace.read_text().splitlines()):
        if record["type"] == "step":
            found += [Diagnostic(d["code"], d["severity"], d["message"], record["step"]) for d in record["diagnostics"]]
        elif record["type"] == "diagnostic":
            found.append(Diagnostic(record["code"], record["severity"], record["message"], record["step"]))
    return found, result.stdout


def line_of(program: Path, text: str) -> str:
    lines = program.read_text().splitlines()
    return f"tests/watch_corpus/{program.name}:{next(i for i, line in enumerate(lines, 1) if text in line)}"


# ---- class 3: an attention mask longer (or shorter) than the cache plus the fed tokens -------------------


def test_a_mask_that_grows_faster_than_the_cache_is_named_at_the_forward(tmp_path):
    program = CORPUS / "mask_longer_than_cache.py"
    found = watched_alarms(program, tmp_path)
    assert {d.code for d in found} == expected_codes(program) == {"mask-length"}
    at = line_of(program, "attention_mask=step_mask")
    # the prefill's mask lines up; each of the 4 decode steps is one more column off: one cause, one group,
    # each message its own forward's counts (and no position-gap counted from the mask's ones)
    assert len(found) == 4 and all(f"[{at}]" in d.message and d.severity == "warning" for d in found)
    assert "18 columns, 1 more than DynamicCache#1's 16 cached + 1 fed tokens (17)" in found[0].message
    assert len({d.message for d in found}) == 4
    assert [(g.code, g.count) for g in group_diagnostics(found)] == [("mask-length", 4)]


def test_the_rule_for_mask_length():
    assert check_mask_length(3, "DynamicCache#1", 17, 16, 1, "") == []
    shorter = check_mask_length(3, "DynamicCache#1", 3, 16, 1, " [p.py:9]")
    assert [(d.code, d.severity, d.step) for d in shorter] == [("mask-length", "warning", 3)]
    assert "3 columns, 14 fewer than DynamicCache#1's 16 cached + 1 fed tokens (17)" in shorter[0].message


# ---- class 7: a loop that reads its cache length from a sliding layer ---------------------------------


def test_a_length_read_from_a_sliding_layer_is_one_position_gap(tmp_path):
    program = CORPUS / "sliding_length_loop.py"
    found = watched_alarms(program, tmp_path)
    assert {d.code for d in found} == expected_codes(program) == {"sliding-eviction", "position-gap"}
    gaps = [d for d in found if d.code == "position-gap"]
    # four decode steps all applied at 7 (the window of 8, less the one slot a sliding layer keeps free):
    # one cause, said once at the forward, not once per growing offset
    assert len(gaps) == 1 and f"[{line_of(program, 'position_ids=positions')}]" in gaps[0].message
    assert "the positions stop growing at 7, the length a sliding layer holds (window 8)" in gaps[0].message
    assert "cache.get_seq_length()" in gaps[0].message
    assert len({d.message for d in found if d.code == "sliding-eviction"}) == 1


def test_positions_stuck_at_the_window_only_past_it():
    assert positions_stuck_at_window([[7]], [26], 8)
    assert positions_stuck_at_window([[8]], [26], 8)
    assert not positions_stuck_at_window([[7]], [7], 8)  # not past the window yet: the right position
    assert not positions_stuck_at_window([[3]], [26], 8)  # another gap: check_row_positions says it
    assert not positions_stuck_at_window([[7]], [26], None)  # no sliding layers

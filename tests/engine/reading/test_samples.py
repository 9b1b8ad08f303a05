"""Every pitfall sample, run headless as a user would, raises the diagnostic it names and no other error."""

from pathlib import Path

import pytest
from plain_python import run_kvtui

from kvtui.engine.chat.script import load_script
from kvtui.engine.records.trace import read_trace

SAMPLES = sorted((Path(__file__).resolve().parents[3] / "samples").glob("*.json"))
# The clean 8-turn chat on SmolLM2 at 16 tokens a turn, not 48: what is asserted (no alarm, every verify ok,
# one buffer a turn) needs the turns, not long replies (at least one verify still runs: verify_every 64).
SHORTER = {"seed-conversation": ["--max-new-tokens", "16"]}


def fired(trace_path):
    trace = read_trace(trace_path)
    found = [(d["code"], d["severity"]) for step in trace.steps for d in step["diagnostics"]]
    found += [(e["code"], e["severity"]) for e in trace.events if e["type"] == "diagnostic"]
    return trace, found


@pytest.mark.parametrize("sample", SAMPLES, ids=[p.stem for p in SAMPLES])
def test_sample_raises_what_it_names(sample, tmp_path):
    script = load_script(sample)
    assert script.description, "a sample says what it shows"
    trace_path = tmp_path / "trace.jsonl"
    run = run_kvtui(  # from a pre-imported Python (tests/plain_python.py): the same CLI, without 8 s of imports
        "--headless",
        "--script",
        str(sample),
        "--trace",
        str(trace_path),
        "--fail-on",
        "error",
        *SHORTER.get(sample.stem, []),
        timeout=900,
    )
    trace, found = fired(trace_path)
    codes = {code for code, _ in found}
    assert set(script.expect) <= codes, (script.expect, found, run.stdout[-2000:])
    errors = {code for code, severity in found if severity == "error"}
    assert errors <= set(script.expect), f"unexpected errors {errors - set(script.expect)}"
    assert run.returncode == (1 if errors else 0), run.stdout[-2000:] + run.stderr[-2000:]
    assert len(trace.buffers) == len(script.turns)
    if not script.expect:  # the clean sample: verify passed wherever it ran
        verifies = [e for e in trace.events if e["type"] == "verify"]
        assert verifies and all(v["ok"] for v in verifies)

"""The headless runner and its trace: the contract other tools rely on."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from plain_python import run_kvtui

from kvtui.engine.chat.script import ScriptError, load_script
from kvtui.engine.records.trace import TraceError, read_trace

STEP_KEYS = {
    "type",
    "step",
    "phase",
    "input_ids",
    "positions",
    "cursor",
    "cache_seq_length",
    "layers",
    "topk",
    "topk_processed",
    "chosen",
    "diagnostics",
    "ms",
}
ROOT = Path(__file__).resolve().parents[3]
LAYER_KEYS = {"index", "kind", "k_shape", "v_shape", "dtype", "device", "bytes", "filled", "capacity"}


def kvtui(*args, timeout=300):
    """The CLI from a pre-imported Python (tests/plain_python.py): what it prints and writes, without 8 s of
    imports a run. A check of the interpreter's own output (a one-line error, no warning) uses real_kvtui."""
    return run_kvtui(*args, timeout=timeout)


def real_kvtui(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "kvtui.cli", *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


def test_headless_run_on_a_tiny_model_writes_a_schema_trace(tiny_dir, tmp_path):
    model = tiny_dir("qwen2")
    script = tmp_path / "chat.json"
    script.write_text(json.dumps({"turns": ["What is k?", "And m?"], "system": "You are terse."}))
    trace = tmp_path / "out.jsonl"
    run = kvtui(
        model, "--headless", "--script", script, "--trace", trace, "--max-new-tokens", "5", "--verify-every", "3"
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "What is k?" in run.stdout and "trace written" in run.stdout
    loaded = read_trace(trace)
    header = loaded.header
    assert header["schema"] == 1 and header["model_class"] == "Qwen2ForCausalLM" and header["layers"] == 2
    assert header["cache"] == "dynamic" and header["capacity"] is None and header["sampler"]["temperature"] == 0
    for key in ("kvtui", "transformers", "torch", "model_path", "dtype", "device", "seed"):
        assert key in header
    assert len(loaded.buffers) == 2
    steps = loaded.steps
    assert steps[0]["phase"] == "prefill" and {"decode"} <= {s["phase"] for s in steps}
    for record in steps:
        assert STEP_KEYS <= set(record)
        assert record["cursor"] == record["cache_seq_length"]
        assert all(LAYER_KEYS <= set(layer) for layer in record["layers"])
        assert {"id", "text", "logit", "prob"} <= set(record["topk"][0])
    # the buffer after each turn is what the steps fed, in order
    fed = [i for s in steps[: 1 + 5] for i in s["input_ids"]]
    assert [t["id"] for t in loaded.buffers[0]["tokens"]] == fed
    assert {"position", "id", "piece", "special", "origin"} <= set(loaded.buffers[0]["tokens"][0])
    verifies = [e for e in loaded.events if e["type"] == "verify"]
    assert verifies and all(v["ok"] for v in verifies)


def test_fail_on_makes_the_exit_code_follow_the_diagnostics(tiny_dir, tmp_path):
    model = tiny_dir("llama", bos=True, eos=True)
    script = tmp_path / "completion.json"
    script.write_text(json.dumps({"mode": "completion", "prompt": "The variable k is equal to 5."}))
    ok = kvtui(model, "--headless", "--script", script, "--max-new-tokens", "2", "--fail-on", "error")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "tokenizer-added-special" in ok.stdout
    failing = kvtui(model, "--headless", "--script", script, "--max-new-tokens", "2", "--fail-on", "warning")
    assert failing.returncode == 1 and "at or above warning" in failing.stdout


def test_static_overflow_is_reported_headless(tiny_dir, tmp_path):
    script = tmp_path / "turns.txt"
    script.write_text("What is k?\nAnd m?\n")
    run = kvtui(
        tiny_dir("qwen2"),
        "--headless",
        "--script",
        script,
        "--cache",
        "static",
        "--max-cache-len",
        "40",
        "--max-new-tokens",
        "20",
    )
    assert run.returncode == 1
    assert "static cache overflow refused: capacity 40" in " ".join(run.stdout.split())


def test_new_counts_the_steps_of_a_turn_a_full_static_cache_cut_short(tiny_dir, tmp_path):
    """The first turn fills the static cache mid-reply (refused there): its row's `new` is the decode steps it made,
    as its trace records them, not 0."""
    script = tmp_path / "turns.txt"
    script.write_text("What is k?\nAnd m?\n")
    trace = tmp_path / "run.jsonl"
    run = run_kvtui(
        *[tiny_dir("qwen2"), "--headless", "--script", script, "--cache", "static"],
        *["--max-cache-len", "40", "--max-new-tokens", "20", "--trace", trace],
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert run.returncode == 1 and "static cache overflow refused" in run.stdout
    decodes = [s for s in read_trace(trace).steps if s["turn"] == 1 and s["phase"] == "decode"]
    assert decodes, "the first turn made decode steps before the cache was full"
    rows = [
        [cell.strip() for cell in line.split("│")[1:-1]] for line in run.stdout.splitlines() if line.startswith("│")
    ]
    header = [
        cell.strip() for cell in next(li for li in run.stdout.splitlines() if li.startswith("┃")).split("┃")[1:-1]
    ]
    first = dict(zip(header, rows[0]))
    assert first["turn"] == "1" and "overflow refused" in first["model"]
    assert first["new"] == str(len(decodes)), run.stdout


def test_a_turn_refused_before_its_prefill_starts_no_turn_in_the_summary(tmp_path):
    """The sample's first message does not fit the static cache at all (refused before any forward): its row has
    no turn number, and the next message, which does start, is turn 1 (as the trace and the TUI number it)."""
    run = kvtui("--headless", "--script", ROOT / "samples" / "static-overflow.json", "--decode-threads", "1")
    rows = [line.split("│")[1].strip() for line in run.stdout.splitlines() if line.startswith("│")]
    assert rows == ["-", "1"], run.stdout


@pytest.mark.version_free("the CLI refuses these before any model or transformers code loads")
def test_clear_errors_for_bad_input(tmp_path):
    missing = real_kvtui(tmp_path / "nope", "--headless", "--script", tmp_path / "x.json")
    assert missing.returncode != 0 and "no such script file" in missing.stderr
    script = tmp_path / "s.json"
    script.write_text('{"turns": ["hi"]}')
    run = real_kvtui(tmp_path / "no-model-here", "--headless", "--script", script)
    assert run.returncode == 2 and "does not exist" in run.stderr and len(run.stderr.strip().splitlines()) == 1
    no_script = real_kvtui("--headless")
    assert no_script.returncode == 2 and "--headless needs --script" in no_script.stderr


def test_script_validation(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"turns": ["hi"], "colour": "red"}')
    with pytest.raises(ScriptError, match="unknown keys"):
        load_script(bad)
    bad.write_text('{"turns": [{"role": "assistant", "content": "hi"}]}')
    with pytest.raises(ScriptError, match="only user turns"):
        load_script(bad)
    bad.write_text('{"turns": ["hi"')
    with pytest.raises(ScriptError, match=r"bad.json:1: not valid JSON"):
        load_script(bad)
    yaml_file = tmp_path / "ok.yaml"
    yaml_file.write_text("turns:\n  - What is k?\nsystem: terse\noptions:\n  cache: static\n  max_cache_len: 64\n")
    script = load_script(yaml_file)
    assert script.turns == ("What is k?",) and script.options == {"cache": "static", "max_cache_len": 64}


def test_trace_reader_names_file_and_line(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"type": "header", "schema": 1}\n{"type": "step", "step": 1\n')
    with pytest.raises(TraceError, match=r"t.jsonl:2: not valid JSON"):
        read_trace(trace)
    trace.write_text('{"type": "header", "schema": 99}\n')
    with pytest.raises(TraceError, match="unknown trace schema 99"):
        read_trace(trace)
    with pytest.raises(TraceError, match="no such trace file"):
        read_trace(tmp_path / "missing.jsonl")


def test_headless_on_the_embedded_smollm2(tmp_path):
    """The real pretrained model: one short greedy turn through the CLI, no model argument."""
    script = tmp_path / "one.txt"
    script.write_text("What is 2+2?\n")
    trace = tmp_path / "smol.jsonl"
    run = kvtui(
        "--headless", "--script", script, "--max-new-tokens", "12", "--trace", trace, "--verify-every", "6", timeout=600
    )
    assert run.returncode == 0, run.stdout + run.stderr
    loaded = read_trace(trace)
    assert loaded.header["model_class"] == "LlamaForCausalLM" and loaded.header["layers"] == 30
    first = loaded.steps[0]
    assert first["layers"][0]["k_shape"][1] == 3 and first["layers"][0]["k_shape"][3] == 64  # 3 KV heads, dim 64
    reply = "".join(s["chosen"]["text"] for s in loaded.steps if s["chosen"])
    assert "4" in reply, reply
    assert all(v["ok"] for v in loaded.events if v["type"] == "verify")


# `kvtui --headless` in a fresh interpreter, noting the OpenMP wait in force when torch (which loads libgomp, the
# runtime that reads it once, at load) is first imported, by the CLI itself.
SPIN_PROBE = r"""
import os, sys
seen = []
sys.addaudithook(lambda event, args: event == "import" and args[0] == "torch" and not seen
                 and seen.append(os.environ.get("GOMP_SPINCOUNT")))
from kvtui.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    assert not exc.code, exc.code
print("PROBE", seen)
"""


@pytest.mark.version_free("OpenMP's wait policy, set by kvtui before torch loads: no transformers code")
@pytest.mark.parametrize("user_setting", [None, "PASSIVE"])
def test_headless_threads_wait_as_the_engines_do_unless_the_user_says(tiny_dir, tmp_path, user_setting):
    from kvtui.engine.records.child import openmp_wait

    script = tmp_path / "chat.txt"
    script.write_text("What is k?\n")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    if user_setting:
        env["OMP_WAIT_POLICY"] = user_setting
    args = ["run", str(tiny_dir("llama")), "--headless", "--script", str(script), "--max-new-tokens", "2"]
    run = subprocess.run(
        [sys.executable, "-c", SPIN_PROBE, *args], capture_output=True, text=True, env=env, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    probe = next(line for line in run.stdout.splitlines() if line.startswith("PROBE"))
    expected = None if user_setting else openmp_wait({})["GOMP_SPINCOUNT"]
    assert probe == f"PROBE [{expected!r}]"  # set before torch loaded, or the user's own setting left alone

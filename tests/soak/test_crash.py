"""Crash: a headless run or a watched program killed with SIGKILL mid-generation leaves a trace whose
finished lines all read back.

A step is written and flushed on the thread that ran its forward, before the forward returns, so a kill
leaves whole lines plus, at worst, one unterminated tail (a large line goes out in several writes).
`read_trace` drops that tail and sets `truncated`; the replay app says the recording was interrupted.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import pytest

from kvtui import viewers
from kvtui.engine.records.replay import Replay
from kvtui.engine.records.trace import TraceError, read_trace

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX SIGKILL")

MIN_STEP_LINES = 25  # kill once the trace holds at least this many finished step lines
START_TIMEOUT = 180.0  # seconds for the subprocess to import torch, load and write them


def step_lines(path) -> int:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0
    return sum(1 for line in data.split(b"\n")[:-1] if line.startswith(b'{"type":"step"'))


LONG_LOOP = """
import sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
for part in range(8):  # far more steps than it can run before the kill: 8 prompts x 500 tokens
    ids = tokenizer(f"Tell me about k, part {part}.", return_tensors="pt")["input_ids"]
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        for _ in range(500):
            ids = model(input_ids=ids, past_key_values=cache).logits[:, -1:].argmax(-1)
"""


@pytest.fixture(scope="module", params=["headless", "watch"])
def killed_trace(request, tiny_dir, tmp_path_factory):
    """The trace of a run killed by SIGKILL once it held MIN_STEP_LINES step lines (one run per module and
    front end): kvtui's own chat headless, and a watched program's loop (its trace written by the
    probe)."""
    model = tiny_dir("qwen2")
    tmp_path = tmp_path_factory.mktemp("killed")
    trace = tmp_path / "killed.jsonl"
    if request.param == "headless":
        script = tmp_path / "long.json"
        # far more steps than it can run before the kill, on any machine: 8 turns x 500 tokens
        script.write_text(json.dumps({"turns": [f"Tell me about k, part {i}." for i in range(8)]}))
        command = [str(model), "--headless", "--script", str(script), "--trace", str(trace), "--max-new-tokens", "500"]
    else:
        program = tmp_path / "long_loop.py"
        program.write_text(LONG_LOOP)
        command = ["watch", "--headless", "--trace", str(trace), str(program), str(model)]
    errors = open(tmp_path / "stderr.txt", "w+b")  # a file, not a pipe: a full pipe would stall the child
    process = subprocess.Popen([sys.executable, "-m", "kvtui.cli", *command], stdout=subprocess.DEVNULL, stderr=errors)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while step_lines(trace) < MIN_STEP_LINES:
            if process.poll() is not None:
                errors.seek(0)
                raise AssertionError(
                    f"the {request.param} run ended before the kill (exit {process.returncode}): "
                    f"{errors.read().decode(errors='replace')[-2000:]}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"no {MIN_STEP_LINES} step lines after {START_TIMEOUT:.0f} s")
            time.sleep(0.01)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        errors.close()
    assert process.returncode == -signal.SIGKILL
    return trace


def test_every_finished_line_of_a_killed_run_reads_back(killed_trace):
    data = killed_trace.read_bytes()
    lines = data.split(b"\n")
    finished, tail = lines[:-1], lines[-1]  # tail: b"" when the kill fell between two lines
    for number, line in enumerate(finished, start=1):
        record = json.loads(line.decode("utf-8"))  # every finished line is a whole record
        assert isinstance(record, dict) and "type" in record, number
    trace = read_trace(killed_trace)
    whole = finished + ([tail] if tail.strip() and _parses(tail) else [])  # a tail missing only its newline counts
    steps = [json.loads(line) for line in whole if line.startswith(b'{"type":"step"')]
    assert len(steps) >= MIN_STEP_LINES
    assert [s["step"] for s in trace.steps] == [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    assert trace.truncated == (tail != b"" and not _parses(tail))
    print(
        f"\nkilled after {len(steps)} finished step lines; unterminated tail {len(tail)} bytes; "
        f"truncated={trace.truncated}"
    )

    replay = Replay(trace)
    assert len(replay) == len(steps)
    last = replay.snapshots[-1]
    assert len(last.buffer) == trace.steps[-1]["buffer_length"]
    assert last.step == trace.steps[-1]["step"] and last.cursor == trace.steps[-1]["cursor"]


def _parses(raw: bytes) -> bool:
    try:
        json.loads(raw.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError and JSONDecodeError are both ValueErrors
        return False
    return True


def cut_cases(finished: list[bytes]):
    """The crash signature, made deterministic: the next line cut mid-write, at the byte level."""
    whole = b"".join(line + b"\n" for line in finished)
    step = [line for line in finished if line.startswith(b'{"type":"step"')][-1]
    note = json.dumps({"type": "note", "text": "caché → interrupted"}, ensure_ascii=False).encode("utf-8")
    inside_arrow = note.index("→".encode()) + 1  # between the bytes of one UTF-8 character
    return {
        "half a step line": whole + step[: len(step) // 2],
        "one byte of a line": whole + b"{",
        "all but the closing brace": whole + step[:-1],
        "inside a UTF-8 character": whole + note[:inside_arrow],
    }


@pytest.mark.parametrize(
    "case", ["half a step line", "one byte of a line", "all but the closing brace", "inside a UTF-8 character"]
)
def test_a_line_cut_mid_write_is_dropped_and_flagged(killed_trace, tmp_path, case):
    finished = killed_trace.read_bytes().split(b"\n")[:-1]
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(cut_cases(finished)[case])
    trace = read_trace(cut)
    assert trace.truncated
    clean = read_trace(_write(tmp_path / "clean.jsonl", b"".join(line + b"\n" for line in finished)))
    assert not clean.truncated
    assert trace.steps == clean.steps and trace.buffers == clean.buffers and trace.events == clean.events
    replay = Replay(trace)
    assert len(replay.snapshots[-1].buffer) == trace.steps[-1]["buffer_length"]
    # strict readers (kvtui diff) still refuse it, naming the file and the cut line
    with pytest.raises(TraceError, match=rf"cut.jsonl:{len(finished) + 1}: the last line is truncated"):
        read_trace(cut, strict=True)


def test_a_bad_line_that_is_not_the_unterminated_tail_still_names_file_and_line(killed_trace, tmp_path):
    finished = killed_trace.read_bytes().split(b"\n")[:-1]
    step = finished[-1]
    # the same half line, but followed by a newline (a finished line that is corrupt), at the end...
    path = _write(
        tmp_path / "bad-end.jsonl", b"".join(line + b"\n" for line in finished) + step[: len(step) // 2] + b"\n"
    )
    with pytest.raises(TraceError, match=rf"bad-end.jsonl:{len(finished) + 1}: not valid JSON"):
        read_trace(path)
    # ...or in the middle, with finished lines after it
    lines = list(finished)
    lines[3] = lines[3][: len(lines[3]) // 2]
    path = _write(tmp_path / "bad-middle.jsonl", b"".join(line + b"\n" for line in lines))
    with pytest.raises(TraceError, match=r"bad-middle.jsonl:4: not valid JSON"):
        read_trace(path)
    # an invalid UTF-8 byte in a finished line names its line too
    lines = list(finished)
    lines[2] = lines[2][:10] + b"\xff" + lines[2][10:]
    path = _write(tmp_path / "bad-utf8.jsonl", b"".join(line + b"\n" for line in lines))
    with pytest.raises(TraceError, match=r"bad-utf8.jsonl:3: not valid UTF-8"):
        read_trace(path)
    # a header cut short is not a trace at all
    path = _write(tmp_path / "no-header.jsonl", finished[0][:20])
    with pytest.raises(TraceError, match=r"no-header.jsonl:1: the header line is cut short"):
        read_trace(path)


async def test_the_replay_app_says_the_recording_was_interrupted(killed_trace, tmp_path, monkeypatch):
    import kvtui.engine.chat.loader as loader

    def no_model(*args, **kwargs):
        raise AssertionError("replay must not load a model")

    monkeypatch.setattr(loader, "load_model", no_model)
    finished = killed_trace.read_bytes().split(b"\n")[:-1]
    cut = _write(tmp_path / "cut.jsonl", cut_cases(finished)["half a step line"])
    app = viewers.replay(cut)
    steps = len(app.view.driver.replay)
    async with app.run_test(size=(140, 45)) as pilot:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while app.view.latest is None:
            assert loop.time() < deadline, "the replay did not show its first step"
            await pilot.pause(0.05)
        await pilot.pause(0.1)
        notes = [str(n.message) for n in app._notifications]
        assert notes.count(f"the recording was interrupted: {steps} finished steps") == 1, notes

    complete = viewers.replay(_write(tmp_path / "whole.jsonl", b"".join(line + b"\n" for line in finished)))
    async with complete.run_test(size=(140, 45)) as pilot:
        await pilot.pause(0.3)
        assert not any("interrupted" in str(n.message) for n in complete._notifications)


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


COUNTING_LOOP = """
import sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
ids = tokenizer("Tell me about k.", return_tensors="pt")["input_ids"]
cache = DynamicCache(config=model.config)
with torch.inference_mode():
    for n in range(1, 100000):
        ids = model(input_ids=ids, past_key_values=cache).logits[:, -1:].argmax(-1)
        print(n, flush=True)  # after the forward returned: step n is finished
"""


def test_a_sigkill_loses_no_step_whose_forward_returned(tiny_dir, tmp_path):
    """The watched program says each finished forward on stdout; killed after it said 40, its trace holds
    at least those 40 steps: the probe writes and flushes a step before the forward returns to the program."""
    program = tmp_path / "counting_loop.py"
    program.write_text(COUNTING_LOOP)
    trace = tmp_path / "killed.jsonl"
    command = ["watch", "--headless", "--trace", str(trace), str(program), str(tiny_dir("qwen2"))]
    errors = open(tmp_path / "stderr.txt", "w+b")
    process = subprocess.Popen(
        [sys.executable, "-m", "kvtui.cli", *command], stdout=subprocess.PIPE, stderr=errors, text=True
    )
    said = 0
    try:
        assert process.stdout is not None
        for line in process.stdout:
            said = int(line) if line.strip().isdigit() else said
            if said >= 40:
                process.send_signal(signal.SIGKILL)
                break
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        errors.seek(0)
        stderr = errors.read().decode(errors="replace")
        errors.close()
    assert said >= 40, stderr[-2000:]
    assert process.returncode == -signal.SIGKILL
    steps = [s["step"] for s in read_trace(trace).steps]
    assert steps[:said] == list(range(1, said + 1)), (len(steps), said)

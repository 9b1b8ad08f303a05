"""`kvtui watch --headless -- COMMAND`: every Python process of a command's tree is watched (a shell script's
python, torchrun's ranks, a multiprocessing spawn child), its output and exit code pass through, and the
trace holds one `process` record per watched process with that process's steps."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from program_headers import codes_in, expected_codes, model_dir

ROOT = Path(__file__).resolve().parents[3]
PROGRAMS = ROOT / "samples" / "programs"
TP_LOOP = PROGRAMS / "tp_loop.py"
# How kvtui reaches every process of a tree and its viewer: run on the newest transformers only. The forwards these
# programs make are watched by the code tests/engine/watch checks on both versions; what stays on both here is
# tensor parallelism (transformers' tp_plan shards the cache differently by version).
PLUMBING = pytest.mark.version_free("process-tree plumbing: the forward it watches is checked on both versions")


def kvtui_watch(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "-m", "kvtui.cli", "watch", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )


def plain(*command, cwd=ROOT):
    return subprocess.run(
        list(map(str, command)), capture_output=True, text=True, timeout=600, cwd=cwd, stdin=subprocess.DEVNULL
    )


def records(trace: Path) -> list[dict]:
    return [json.loads(line) for line in trace.read_text().splitlines()]


def torchrun(*args):
    # the launcher as users call it: the console script beside this interpreter
    return [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2", *args]


@pytest.fixture(scope="module")
def llama_dir():
    return model_dir("tiny:llama")  # 2 KV heads: a 2-rank tensor-parallel plan holds one per rank


@PLUMBING
def test_a_shell_scripts_python_is_watched_and_its_output_and_exit_code_pass_through(tmp_path):
    program = PROGRAMS / "hidden_eos.py"
    model = model_dir("tiny:llama,eos=1")
    script = tmp_path / "run.sh"
    script.write_text(f"#!/bin/sh\necho before\n{sys.executable} {program} {model}\necho after\nexit 3\n")
    script.chmod(0o755)
    trace = tmp_path / "tree.jsonl"
    watched = kvtui_watch("--headless", "--trace", trace, "--fail-on", "error", "--", script)
    unwatched = plain(script)
    assert watched.stdout == unwatched.stdout and watched.stdout.startswith("before\n")
    assert watched.returncode == unwatched.returncode == 3, watched.stderr[-2000:]
    found = records(trace)
    processes = [r for r in found if r["type"] == "process"]
    assert len(processes) == 1 and processes[0]["argv"][0] == str(program) and processes[0]["finished"]
    assert processes[0]["rank"] is None
    steps = [r for r in found if r["type"] == "step"]
    assert steps and all(s["pid"] == processes[0]["pid"] for s in steps)
    assert codes_in(trace) == expected_codes(program)
    assert "1 process(es) built a causal LM" in watched.stderr


def test_torchrun_ranks_each_record_their_shard_and_agree_with_one_process(tmp_path, llama_dir, tiny_model):
    trace = tmp_path / "tp.jsonl"
    watched = kvtui_watch("--headless", "--trace", trace, "--fail-on", "warning", "--", *torchrun(TP_LOOP, llama_dir))
    unwatched = plain(*torchrun(TP_LOOP, llama_dir))
    assert watched.returncode == unwatched.returncode == 0, watched.stderr[-3000:]
    assert watched.stdout == unwatched.stdout and "(1, 1," in watched.stdout  # rank 0 prints its shard's shape

    found = records(trace)
    processes = {r["rank"]: r for r in found if r["type"] == "process"}
    assert sorted(processes) == [0, 1] and all(p["world_size"] == 2 for p in processes.values())
    steps = {rank: [r for r in found if r["type"] == "step" and r["pid"] == p["pid"]] for rank, p in processes.items()}
    assert all(len(s) == 8 == processes[rank]["steps"] for rank, s in steps.items())  # 8 forwards each
    for rank_steps in steps.values():
        assert all(layer["k_shape"][1] == 1 for s in rank_steps for layer in s["layers"])  # 1 of 2 KV heads

    # An independent recomputation: the unsharded model, one full forward over the same tokens.
    model, _ = tiny_model("llama")
    assert model.config.num_key_value_heads == 2
    fed = [i for s in steps[0] for i in s["input_ids"]]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([fed]), use_cache=False).logits[0]  # [n, vocab]
    ends = [sum(len(s["input_ids"]) for s in steps[0][: i + 1]) - 1 for i in range(len(steps[0]))]
    for rank_steps in steps.values():
        assert [s["topk"][0]["id"] for s in rank_steps] == [int(logits[end].argmax()) for end in ends]
        for s, end in zip(rank_steps, ends):
            probs = torch.softmax(logits[end], -1)
            for top in s["topk"][:3]:
                assert top["prob"] == pytest.approx(float(probs[top["id"]]), abs=1e-5)
    assert "rank-desync" not in watched.stderr
    assert "KV heads held per layer: 1" in watched.stderr
    length = steps[0][-1]["layers"][0]["k_shape"][2]
    assert f"shards, merged: K 1×2×{length}×16 · 2 ranks × 1 head (layer 0, forward 8)" in watched.stderr


@pytest.mark.version_free(
    "the rank-desync rule over the ranks' records: their tensor-parallel forward is watched on both versions by the "
    "torchrun shard test above"
)
def test_ranks_that_feed_different_tokens_raise_rank_desync(tmp_path, llama_dir, tp_loop_with):
    program = tmp_path / "tp_desync.py"
    # rank 1 changes one prompt token (the same length: the collectives still match, the context does not)
    source = tp_loop_with(
        "if int(os.environ.get('RANK', '0')) == 1:\n    ids[0, 2] = (ids[0, 2] + 1) % model.config.vocab_size",
        "cache = DynamicCache(config=model.config)",
    )
    program.write_text(source)
    trace = tmp_path / "desync.jsonl"
    result = kvtui_watch("--headless", "--trace", trace, "--fail-on", "error", "--", *torchrun(program, llama_dir, 3))
    assert result.returncode == 1, result.stderr[-3000:]
    desync = [r for r in records(trace) if r["type"] == "diagnostic" and r["code"] == "rank-desync"]
    assert len(desync) == 1 and desync[0]["step"] == 1 and "fed ids" in desync[0]["message"]
    assert "rank-desync" in result.stderr


@PLUMBING
def test_a_multiprocessing_spawn_child_is_watched(tmp_path, llama_dir):
    program = tmp_path / "spawn.py"
    program.write_text("""
import multiprocessing as mp
import sys


def work(model_dir):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([[5, 6, 7]]))
    print("child", out.logits.shape[1], flush=True)


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=work, args=(sys.argv[1],))
    child.start()
    child.join()
    print("parent done", child.exitcode)
""")
    trace = tmp_path / "spawn.jsonl"
    result = kvtui_watch("--headless", "--trace", trace, "--", sys.executable, program, llama_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == "child 3\nparent done 0\n"
    processes = [r for r in records(trace) if r["type"] == "process"]
    assert len(processes) == 1 and processes[0]["steps"] == 1  # the child built the model; the parent none


@PLUMBING
def test_a_command_that_builds_no_model_keeps_its_exit_code_and_says_so():
    result = kvtui_watch("--headless", "--", sys.executable, "-c", "import sys; print('hi'); sys.exit(4)")
    assert result.stdout == "hi\n" and result.returncode == 4
    assert "no process of" in result.stderr and "built a causal LM" in result.stderr


@PLUMBING
def test_an_unknown_command_is_one_line_and_exit_2():
    result = kvtui_watch("--headless", "--", "kvtui-no-such-command-anywhere", "x")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "kvtui watch: kvtui-no-such-command-anywhere: no such script or command"
    ]


@PLUMBING
def test_nothing_of_kvtui_is_left_in_the_programs_view(tmp_path):
    """The hook takes its own directory off sys.path and chains an existing sitecustomize."""
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import builtins\nbuiltins.OWN_SITECUSTOMIZE = True\n")
    program = tmp_path / "show.py"
    program.write_text(
        "import builtins, sys\nprint(getattr(builtins, 'OWN_SITECUSTOMIZE', False))\n"
        "print(any('kvtui-watch-tree' in p for p in sys.path))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(own)}
    result = subprocess.run(
        [sys.executable, "-m", "kvtui.cli", "watch", "--headless", "--", sys.executable, str(program)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert result.stdout == "True\nFalse\n", result.stderr[-2000:]


def _start_viewer(*args):
    """A viewer whose stderr is read line by line on a thread (the listening line comes first)."""
    viewer = subprocess.Popen(
        [sys.executable, "-m", "kvtui.cli", "watch", *map(str, args)],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    listening = threading.Event()

    def read():
        for line in viewer.stderr:
            lines.append(line)
            if "listening on" in line:
                listening.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return viewer, lines, listening, reader


def _address_and_token(lines: list[str]) -> tuple[str, str]:
    found = re.search(r"--connect (\S+) --token (\S+)", "".join(lines))
    return found.group(1), found.group(2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@PLUMBING
def test_two_nodes_over_a_loopback_rendezvous_report_to_one_viewer(tmp_path, llama_dir):
    port = _free_port()
    launch = [
        str(Path(sys.executable).parent / "torchrun"),
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "kvtui-test",
        str(TP_LOOP),
        str(llama_dir),
    ]
    trace = tmp_path / "nodes.jsonl"
    viewer, lines, listening, reader = _start_viewer(
        "--headless", "--listen", "127.0.0.1:0", "--trace", trace, "--", *launch
    )
    assert listening.wait(60), "".join(lines)
    address, token = _address_and_token(lines)
    other = kvtui_watch("--headless", "--connect", address, "--token", token, "--", *launch)
    viewer.stdout.read()  # drained until the viewer closes it (stderr is the reader thread's)
    viewer.wait(300)
    reader.join(10)
    assert viewer.returncode == 0 and other.returncode == 0, "".join(lines)[-3000:] + other.stderr[-2000:]
    processes = {r["rank"]: r for r in records(trace) if r["type"] == "process"}
    assert sorted(processes) == [0, 1] and all(p["world_size"] == 2 and p["steps"] == 8 for p in processes.values())
    steps = [r for r in records(trace) if r["type"] == "step"]
    assert {s["rank"] for s in steps} == {0, 1}
    assert all(layer["k_shape"][1] == 1 for s in steps for layer in s["layers"])
    assert "2 process(es) built a causal LM" in "".join(lines)


@PLUMBING
def test_a_connection_without_the_token_is_dropped_and_the_run_goes_on():
    viewer, lines, listening, reader = _start_viewer(
        "--headless", "--listen", "127.0.0.1:0", "--", sys.executable, "-c", "import time; time.sleep(4); print('done')"
    )
    assert listening.wait(60), "".join(lines)
    address, token = _address_and_token(lines)
    host, port = address.rsplit(":", 1)
    for first_line in (json.dumps({"type": "hello", "token": token + "x", "pid": 1}), "garbage, not json"):
        with socket.create_connection((host, int(port))) as intruder:
            intruder.sendall(first_line.encode() + b"\n")
            intruder.settimeout(10)
            assert intruder.recv(10) == b""  # the viewer hung up
    stdout = viewer.stdout.read()
    viewer.wait(60)
    reader.join(10)
    assert stdout == "done\n" and viewer.returncode == 0
    assert sum("no valid token" in line for line in lines) == 2, "".join(lines)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in state  # a zombie has ended; only its parent's wait is missing


READY = "ready {} {}\n"  # a rank's pid and its launcher's


@PLUMBING
def test_a_killed_viewer_leaves_no_rank_behind(tmp_path, llama_dir, tp_loop_with):
    program = tmp_path / "forever.py"
    program.write_text(
        # one write per line: under torchrun a rank's stdout is unbuffered (`python -u`), where print() writes each
        # piece apart, and two ranks' pieces can interleave into lines that never name all three processes
        tp_loop_with(
            f"os.write(1, {READY!r}.format(os.getpid(), os.getppid()).encode())\nNEW_TOKENS = 10**9", "out_ids = []"
        )
    )
    viewer = subprocess.Popen(
        [sys.executable, "-m", "kvtui.cli", "watch", "--headless", "--", *torchrun(program, llama_dir)],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # its group: what is left of the tree if the ranks never say they are ready
    )
    pids = set()
    # the ranks never end by themselves: a test that waits for them ends, its tree killed
    watchdog = threading.Timer(300, os.killpg, (viewer.pid, signal.SIGKILL))
    watchdog.start()
    try:
        for line in viewer.stdout:
            if line.startswith("ready"):
                pids.update(int(p) for p in line.split()[1:])
            if len(pids) == 3:  # two ranks and their launcher
                break
    finally:
        watchdog.cancel()
    assert len(pids) == 3, f"the two ranks did not both say they were ready within 300 s: {pids}"
    time.sleep(1.0)  # both ranks are past their first forwards: watched and connected
    viewer.kill()
    viewer.wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(map(_gone, pids)):
        time.sleep(0.2)
    left = [pid for pid in pids if not _gone(pid)]
    for pid in left:
        os.kill(pid, 9)
    assert not left, f"still running after the viewer was killed: {left}"


@PLUMBING
def test_a_viewer_killed_before_it_accepted_still_ends_the_process():
    """A loaded viewer SIGKILLed with this connection still in its listen queue: the read ends in a reset,
    not an end of file, and the watched process must still go (CI saw two ranks outlive their viewer)."""
    from kvtui.engine.records.stream import RecordPipe
    from kvtui.engine.watch.child import control_gate

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    connection = socket.create_connection(server.getsockname())
    connection.sendall(b'{"type": "hello"}\n')
    gone = threading.Event()
    pipe = RecordPipe(os.dup(connection.fileno()))
    control_gate(os.dup(connection.fileno()), pipe, on_gone=gone.set)
    assert not gone.wait(0.3)  # the viewer is alive: the program runs on
    server.close()  # never accepted: the kernel resets the connection
    assert gone.wait(10), "the control reader died on the reset without ending the process"
    pipe.close()
    connection.close()


@PLUMBING
def test_pytest_xdist_workers_name_the_fixture_that_tokenized(tmp_path):
    """The motivating bug report: a session-scoped fixture whose tokenizer appends EOS, in a worker process."""
    model = model_dir("tiny:llama,eos=1")
    (tmp_path / "conftest.py").write_text(f"""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache


@pytest.fixture(scope="session")
def initialized_session_state():
    tokenizer = AutoTokenizer.from_pretrained({str(model)!r})
    model = AutoModelForCausalLM.from_pretrained({str(model)!r}, dtype=torch.float32)
    cache = DynamicCache(config=model.config)
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    return cache
""")
    for name in ("a", "b"):
        (tmp_path / f"test_{name}.py").write_text(
            "def test_cache(initialized_session_state):\n    assert initialized_session_state.get_seq_length() > 0\n"
        )
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2"]
    watched = subprocess.run(
        [sys.executable, "-m", "kvtui.cli", "watch", "--headless", "--fail-on", "error", "--", *command],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
    )
    assert watched.returncode == 0, watched.stdout[-2000:] + watched.stderr[-3000:]  # pytest's own: all passed
    assert "2 passed" in watched.stdout
    line = 1 + (tmp_path / "conftest.py").read_text().splitlines().index(  # the forward that fed the ids
        "        model(input_ids=ids, past_key_values=cache, use_cache=True)"
    )
    alarms = [text for text in watched.stderr.splitlines() if "tokenizer-added-special" in text]
    assert len(alarms) == 2 and all(
        f"[conftest.py:{line} in fixture initialized_session_state]" in text for text in alarms
    ), watched.stderr[-3000:]
    assert "2 process(es) built a causal LM" in watched.stderr  # the two workers, not the controller


@PLUMBING
def test_a_killed_viewers_hook_directory_is_swept_by_the_next_start(tmp_path):
    """A SIGKILLed viewer runs no cleanup: its hook directory (a sitecustomize.py) stays in the temporary
    directory. The next viewer removes every hook directory whose viewer's pid is gone, and only those."""
    from kvtui.engine.watch.tree import HOOK_PREFIX, sweep_hook_directories

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid names no process now
    dead = tmp_path / f"{HOOK_PREFIX}{gone.pid}-abc"
    live = tmp_path / f"{HOOK_PREFIX}{os.getpid()}-def"
    other = tmp_path / "kvtui-engine-123-x"  # not a hook directory
    old = tmp_path / f"{HOOK_PREFIX}x8ab_3kd"  # an older kvtui's name, without a pid: left alone
    for path in (dead, live, other, old):
        path.mkdir()
        (path / "sitecustomize.py").write_text("")
    assert sweep_hook_directories(tmp_path) == [dead]
    assert not dead.exists() and live.exists() and other.exists() and old.exists()


@PLUMBING
def test_a_closed_tree_server_leaves_no_thread_listening():
    """close() ends the accept thread at once (a socket's close alone does not wake a thread blocked in accept()
    on Linux: an in-process viewer kept one `kvtui-tree-accept` thread per watched tree until the process ended)."""
    from kvtui.engine.watch.tree import TreeServer

    server = TreeServer()
    host, port = server.address.rsplit(":", 1)
    assert any(t.name == "kvtui-tree-accept" and t.is_alive() for t in threading.enumerate())
    server.close()
    assert not any(t.name == "kvtui-tree-accept" and t.is_alive() for t in threading.enumerate())
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=1).close()

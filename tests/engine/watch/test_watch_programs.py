"""`kvtui watch --headless` on the sample programs, through the real CLI (the alarms each raises are checked
with its plain run in test_transparency.py): output and exit codes pass through, interactive programs, traces."""

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from program_headers import codes_in, header, model_dir

ROOT = Path(__file__).resolve().parents[3]
PROGRAMS = sorted((ROOT / "samples" / "programs").glob("*.py"))
# the launcher's plumbing, on programs that import no transformers: kvtui's patches of each transformers version are
# installed and checked on both versions by the watched programs of test_transparency.py and the chat sample below
LAUNCHER = pytest.mark.version_free("the launcher's plumbing around a program that builds no model")


def watch(*args, cwd=ROOT, input=None, env=None, cli=(sys.executable, "-m", "kvtui.cli"), timeout=600):
    """The CLI (`cli`: how kvtui is started); the program's stdin is `input` (else /dev/null: an interactive sample
    reads EOF and ends)."""
    return _run([*cli, "watch", *args], cwd, input, env, timeout)


def plain(*args, cwd=ROOT):
    """`python ARGS`, as `watch` runs the CLI: the same program without kvtui."""
    return _run([sys.executable, *args], cwd)


def _run(command, cwd, input=None, env=None, timeout=600):
    stdin = {"input": input} if input is not None else {"stdin": subprocess.DEVNULL}
    return subprocess.run(
        list(map(str, command)), capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env, **stdin
    )


def test_every_program_names_its_model_and_alarms():
    assert len(PROGRAMS) >= 5
    for program in PROGRAMS:
        assert header(program, "kvtui-model") and header(program, "kvtui-expects")


# Each sample raises exactly the alarms its header names, names the line that made the call, and exits as the
# alarms say: checked on the watched run of tests/engine/watch/test_transparency.py, which also compares it with the
# plain run.


@LAUNCHER
def test_program_output_passes_through_and_exit_code_is_kept(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("import sys\nprint('hello from the program')\nsys.exit(3)\n")
    result = watch("--headless", script)
    assert result.stdout == "hello from the program\n"
    assert result.returncode == 3
    assert "0 forwards watched" in result.stderr and "models: none" in result.stderr


@LAUNCHER
@pytest.mark.parametrize(
    "args,hint",
    [
        (["--headless", "no-such-file.py"], "SCRIPT"),
        (["--headless", "-m", "no_such_module_xyz"], "-m"),
        (["--headless", "--trace", "/no/such/dir/t.jsonl", __file__], "--trace"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, hint):
    result = watch(*args)
    assert result.returncode == 2
    assert hint in result.stderr and "Traceback" not in result.stderr


@LAUNCHER
def test_headless_program_reads_piped_stdin(tmp_path):
    """--headless runs the program in this process: its input() reads kvtui's own stdin, to EOF."""
    script = tmp_path / "loop.py"
    script.write_text(
        "while True:\n    try:\n        line = input('you> ')\n    except EOFError:\n        break\n"
        "    print('got', repr(line))\nprint('bye')\n"
    )
    result = watch("--headless", script, input="hello\nsecond line\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "you> got 'hello'\nyou> got 'second line'\nyou> bye\n"


def test_chat_sample_chats_over_piped_stdin(tmp_path):
    """The interactive sample keeps one cache across turns: each turn's cache starts where the last ended."""
    program = ROOT / "samples" / "programs" / "chat_input.py"
    trace = tmp_path / "chat.jsonl"
    result = watch(
        "--headless",
        "--trace",
        trace,
        program,
        model_dir(header(program, "kvtui-model")),
        4,
        input="hello\nhow are you?\nquit\nnever read\n",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lengths = [int(n) for n in re.findall(r"\[cache: (\d+) tokens\]", result.stdout)]
    assert len(lengths) == 2 and lengths[1] > lengths[0], result.stdout
    steps = [r for r in map(json.loads, trace.read_text().splitlines()) if r["type"] == "step"]
    assert len({s["cache_id"] for s in steps}) == 1  # one cache for the whole chat
    assert codes_in(trace) == set()
    ended = watch("--headless", program, model_dir(header(program, "kvtui-model")))  # no input at all: EOF at once
    assert ended.returncode == 0 and ended.stdout == "you> \nbye\n", ended.stderr[-2000:]
    assert "0 forwards watched" in ended.stderr


@LAUNCHER
def test_module_mode_runs_with_its_args(tmp_path):
    (tmp_path / "mytool").mkdir()
    (tmp_path / "mytool" / "__init__.py").write_text("")
    (tmp_path / "mytool" / "__main__.py").write_text("import sys\nprint('args', sys.argv[1:])\n")
    result = watch("--headless", "-m", "mytool", "--flag", "x", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "args ['--flag', 'x']\n"


# A program that reads its own process before its imports, then sets a variable that torch reads when it loads
IMPORTS_FIRST = textwrap.dedent("""
    import os, sys
    print("loaded before the program's imports:", sorted(m for m in ("torch", "transformers") if m in sys.modules))
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    from transformers import AutoModelForCausalLM
    print("threads:", torch.get_num_threads(), flush=True)
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
    with torch.no_grad():
        print("next id:", model(input_ids=torch.tensor([[1, 2, 3]])).logits[0, -1].argmax().item())
""")


def test_kvtui_imports_torch_and_transformers_after_the_program_does(tmp_path, tiny_dir):
    """kvtui's probe loads once the program's own imports reach transformers' model or tokenizer code (headless and
    in the TUI's child process alike): the program sees its own sys.modules and keeps the OMP_NUM_THREADS it set
    before importing torch, prints what it prints without kvtui, and its model is still watched."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvtui.engine.watch.child import ProgramSource

    script, model = tmp_path / "imports_first.py", str(tiny_dir("llama"))
    script.write_text(IMPORTS_FIRST)
    with torch.no_grad():  # what the program prints without kvtui (its next id, computed here)
        logits = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)(input_ids=torch.tensor([[1, 2, 3]]))
    expected = f"loaded before the program's imports: []\nthreads: 1\nnext id: {logits.logits[0, -1].argmax().item()}\n"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # what the program sets is what counts
    headless = watch("--headless", script, model, env=env)
    assert headless.returncode == 0, headless.stderr[-2000:]
    assert headless.stdout == expected
    assert "kvtui watch: 1 forwards watched" in headless.stderr, headless.stderr
    saved = os.environ.pop("OMP_NUM_THREADS", None)  # the child inherits this process's environment
    try:
        records = list(ProgramSource(str(script), [model]).records())
    finally:
        if saved is not None:
            os.environ["OMP_NUM_THREADS"] = saved
    printed = "".join(r["text"] + "\n" for r in records if r["type"] == "output" and r["stream"] == "stdout")
    assert printed == expected
    assert [r["step"] for r in records if r["type"] == "step"] == [1]


@LAUNCHER
def test_a_watcher_that_cannot_be_made_leaves_the_program_running(tmp_path, capsys):
    """kvtui's failure inside the program's own import of transformers is one line on stderr, never the program's
    error: the program runs to its end unwatched and its exit code is its own."""
    from kvtui.engine.watch.deferred import run_deferred

    script = tmp_path / "uses_transformers.py"
    script.write_text("import sys\nimport transformers.modeling_utils\nprint('ran to the end')\nsys.exit(4)\n")

    def make_watcher():
        raise RuntimeError("no watcher today")

    code, watcher, models = run_deferred(make_watcher, str(script), [])
    out, err = capsys.readouterr()
    assert (code, watcher, models) == (4, None, [])
    assert out == "ran to the end\n"
    assert "kvtui watch: not watching this program: RuntimeError: no watcher today" in err


# ---- the program's own __main__, argv and traceback ---------------------------------------------------------

IDENTITY = """\
import sys, traceback
def annotated(x: int) -> str: ...
print(__file__, sys.argv, sys.path[0], __name__, __package__, __spec__, type(__loader__).__name__)
print(type(__builtins__).__name__, sorted(k for k in globals() if k.startswith("__")), annotated.__annotations__)
traceback.print_stack(limit=1)
def nested():
    raise ValueError("the program's own error")
nested()
"""
OWN_HOOK = """\
import sys
def hook(kind, value, tb):
    print("the program's hook:", kind.__name__, value, tb.tb_frame.f_code.co_filename, tb.tb_lineno, file=sys.stderr)
sys.excepthook = hook
raise RuntimeError("to the hook")
"""
MODULE = """\
import sys
print(sys.argv, __file__, __name__, __package__, __spec__.name, type(__builtins__).__name__)
def nested():
    raise KeyError("k")
nested()
"""


def _without_report(stderr: str) -> str:
    """stderr without the headless report's own lines (kvtui's summary after the program's output)."""
    return "".join(line for line in stderr.splitlines(True) if not line.startswith(("kvtui watch:", "waste:")))


@LAUNCHER
@pytest.mark.parametrize("how", ["script", "own hook", "module"])
def test_a_watched_program_runs_as_python_runs_it(tmp_path, how):
    """Its `__main__` (an absolute, unnormalised `__file__`, the loader, no package, the builtins module, no
    `from __future__` of kvtui's), argv, sys.path[0], and an uncaught exception given to its own sys.excepthook
    with python's traceback (no frame of kvtui's, the script named by its absolute path): stdout, stderr and exit
    code as `python PROG` / `python -m MOD` from a subfolder, the headless report aside."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text(MODULE)
    (tmp_path / "identity.py").write_text(IDENTITY)
    (tmp_path / "own_hook.py").write_text(OWN_HOOK)
    cwd = tmp_path / "sub" if how != "module" else tmp_path
    argv = {
        "script": ["../identity.py", "an argument"],
        "own hook": ["../own_hook.py"],
        "module": ["-m", "pkg.mod", "x"],
    }
    unwatched = plain(*argv[how], cwd=cwd)
    watched = watch("--headless", *argv[how], cwd=cwd)
    assert unwatched.returncode == 1 and unwatched.stderr  # the program's error, to compare
    assert (watched.returncode, watched.stdout) == (unwatched.returncode, unwatched.stdout)
    assert _without_report(watched.stderr) == unwatched.stderr
    assert "kvtui/engine" not in _without_report(watched.stderr)


@LAUNCHER
def test_the_kvtui_command_runs_a_module_of_the_current_folder(tmp_path):
    """`kvtui watch -m pkg.mod` through the installed console script (whose sys.path, unlike `python -m kvtui.cli`'s,
    lacks the current folder) finds the module where `python -m pkg.mod` does."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text("import sys\nprint(sys.argv)\n")
    watched = watch("--headless", "-m", "pkg.mod", "x", cwd=tmp_path, cli=[Path(sys.executable).with_name("kvtui")])
    assert watched.returncode == 0, watched.stderr
    assert watched.stdout == f"{[str(tmp_path / 'pkg' / 'mod.py'), 'x']}\n"


THREAD_OUTLIVES_MAIN = textwrap.dedent("""
    import sys, threading
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
    started = threading.Event()
    def decode():
        started.wait()  # the main thread's code has ended by then
        cache = DynamicCache()
        with torch.no_grad():
            out = model(input_ids=torch.tensor([[1, 2, 4]]), past_key_values=cache)
            for _ in range(4):
                out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache)
        print("thread done at", cache.get_seq_length())
    threading.Thread(target=decode).start()
    print("main done")
    threading.Timer(0.5, started.set).start()
""")


def test_forwards_of_a_thread_that_outlives_the_main_thread_are_watched(tmp_path, tiny_dir):
    """python exits once the threads that are not daemons have ended: kvtui watches their forwards to the last and
    reports after them (it reported 0 forwards and wrote no trace when the main thread's code ended first)."""
    script, trace = tmp_path / "outlives.py", tmp_path / "run.jsonl"
    script.write_text(THREAD_OUTLIVES_MAIN)
    watched = watch("--headless", "--trace", trace, script, tiny_dir("llama"))
    assert watched.returncode == 0, watched.stderr[-2000:]
    assert watched.stdout == "main done\nthread done at 7\n"
    assert "kvtui watch: 5 forwards watched" in watched.stderr, watched.stderr
    steps = [json.loads(line) for line in trace.read_text().splitlines() if '"type":"step"' in line]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    assert steps[-1]["cache_seq_length"] == 7


def test_the_trace_goes_where_the_command_line_said_when_the_program_changes_folder(tmp_path, tiny_dir):
    """`--trace run.jsonl` is relative to where kvtui was started, not to the folder the program is in at its first
    forward (kvtui's watcher is made, and the file opened, only then)."""
    script = tmp_path / "moves.py"
    script.write_text(
        "import os, sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)\n"
        "os.chdir(sys.argv[2])\n"
        "with torch.no_grad():\n"
        "    model(input_ids=torch.tensor([[1, 2, 4]]))\n"
    )
    (tmp_path / "later").mkdir()
    watched = watch("--headless", "--trace", "run.jsonl", script, tiny_dir("llama"), tmp_path / "later", cwd=tmp_path)
    assert watched.returncode == 0, watched.stderr[-2000:]
    assert "trace written to run.jsonl" in watched.stderr
    assert (tmp_path / "run.jsonl").exists() and not (tmp_path / "later" / "run.jsonl").exists()


WARNINGS_ARE_ERRORS = textwrap.dedent("""
    import sys, warnings
    warnings.simplefilter("error")  # every warning raised from here on is an exception, kvtui's code's too
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
    ids = torch.tensor([[1, 2, 4, 5]])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    print(out.tolist())
""")


def test_a_program_that_makes_warnings_errors_runs_and_ends_as_plain(tmp_path, tiny_dir):
    """A program's warning filters apply to the code kvtui runs inside its forwards (kvtui raises no warning there)
    and not to kvtui's report after it: a program that turns every warning into an error prints and exits as plain,
    every forward watched, no kvtui failure (the report's deprecated click call raised, exit code 1)."""
    script, model = tmp_path / "strict.py", str(tiny_dir("llama"))
    script.write_text(WARNINGS_ARE_ERRORS)
    unwatched = plain(script, model)
    watched = watch("--headless", script, model)
    assert unwatched.returncode == 0, unwatched.stderr[-2000:]
    assert (watched.returncode, watched.stdout) == (0, unwatched.stdout), watched.stderr[-2000:]
    assert "kvtui watch: 4 forwards watched" in watched.stderr
    assert "worker-error" not in watched.stderr and "Traceback" not in watched.stderr, watched.stderr[-2000:]


@LAUNCHER
def test_a_trace_that_cannot_be_written_is_refused_before_the_program_runs(tmp_path):
    """The trace file opens at the program's first forward: a destination that cannot be written is said at once, the
    program not started; a trace asked for but never opened (no forward) is said as such, no file left behind."""
    script = tmp_path / "says.py"
    script.write_text("print('ran')\n")
    (tmp_path / "a_file").write_text("")
    refused = watch("--headless", "--trace", tmp_path / "a_file" / "run.jsonl", script)
    assert refused.returncode == 2 and refused.stdout == ""
    assert "cannot write the trace" in refused.stderr, refused.stderr
    ran = watch("--headless", "--trace", tmp_path / "run.jsonl", script)
    assert ran.returncode == 0 and ran.stdout == "ran\n"
    assert "no trace written to" in ran.stderr and "no forward was watched" in ran.stderr, ran.stderr
    assert not (tmp_path / "run.jsonl").exists()


POOLS_LEFT_OPEN = textwrap.dedent("""\
    import sys
    from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
    def decode(first):
        cache = DynamicCache()
        with torch.no_grad():
            out = model(input_ids=torch.tensor([[first, 2, 4]]), past_key_values=cache)
            model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache)
        print("decoded", first, cache.get_seq_length(), flush=True)
    threads = ThreadPoolExecutor(1)  # never shut down: python stops its thread at exit, after the queued work
    for first in (1, 3):
        threads.submit(decode, first)
    processes = ProcessPoolExecutor(1)  # never shut down either
    print("pow", processes.submit(pow, 6, 2).result(), flush=True)
    print("main done", flush=True)
""")


def test_pools_the_program_never_shut_down_end_as_python_ends_them(tmp_path, tiny_dir):
    """python stops the pool threads a program left open at exit (concurrent.futures' exit callbacks, before it
    joins the threads that are not daemons), once their queued work is done: under kvtui the run hung for good,
    waiting for an idle pool thread. Their forwards are watched to the last."""
    script, trace = tmp_path / "pools.py", tmp_path / "run.jsonl"
    script.write_text(POOLS_LEFT_OPEN)
    ran = plain(script, tiny_dir("llama"))
    watched = watch("--headless", "--trace", trace, script, tiny_dir("llama"), timeout=300)
    assert ran.returncode == watched.returncode == 0, watched.stderr[-2000:]
    lines = ["decoded 1 4", "decoded 3 4", "main done", "pow 36"]
    assert sorted(ran.stdout.splitlines()) == sorted(watched.stdout.splitlines()) == lines  # the pool's lines race
    assert "kvtui watch: 4 forwards watched" in watched.stderr, watched.stderr
    assert sum('"type":"step"' in line for line in trace.read_text().splitlines()) == 4


@LAUNCHER
def test_a_program_run_in_a_process_leaves_that_processs_own_pools_working(tmp_path):
    """kvtui ends only the pools the program started: a host process's executors (a test runner's, an event loop's
    default one) keep working after it, and their idle threads never hold the program's end."""
    from concurrent.futures import ThreadPoolExecutor

    from kvtui.engine.watch.program import run_program

    host = ThreadPoolExecutor(1)
    assert host.submit(int, "1").result() == 1  # its idle thread, alive before the program
    script = tmp_path / "pool.py"
    script.write_text(
        "from concurrent.futures import ThreadPoolExecutor\npool = ThreadPoolExecutor(1)\n"
        "print(pool.submit(pow, 2, 5).result())\n"
    )
    codes = []
    runner = threading.Thread(target=lambda: codes.append(run_program(str(script), [])), daemon=True)
    runner.start()
    runner.join(timeout=60)
    assert not runner.is_alive(), "run_program is still waiting after 60 s"
    assert codes == [0]
    assert host.submit(int, "2").result(timeout=10) == 2
    assert ThreadPoolExecutor(1).submit(int, "3").result(timeout=10) == 3
    host.shutdown()

"""The plain half of a plain-vs-watched test, run without paying for `import torch, transformers` every time.

A fresh Python spends ~8 s of CPU here importing torch and transformers before a tiny program's first line, and
under a whole suite's load several times that: the plain run of a corpus program was half of its test. A
`PlainPython` is one Python (per test process and environment) that imported them once and forks a child per
program: the child points fds 0-2 at the run's files, runs the script as `python PROGRAM ARGS...` would (argv,
sys.path[0], `__main__`, cwd), then ends as the interpreter ends (non-daemon threads joined, atexit handlers,
streams flushed; a SystemExit's code, or a traceback and 1). A run measured here: 0.6 s instead of 9 s.

Only the reference run goes through here; the watched run stays a real `python -m kvtui.cli watch` process, so a
difference between this emulation and a real interpreter could only make a test fail, never pass.

The TUI tests' engine processes (`python -m kvtui.engine.chat.host`, one per app) are forked here too
(`forked_engines`): the same module and arguments, its pipes handed over (SCM_RIGHTS), in a session of its own;
a test marked `real_engine` starts a real one (the engine process's own life: killed, exited, restarted).
"""

from __future__ import annotations

import atexit
import io
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

# what every corpus program imports first (the model classes of the tiny models and the embedded SmolLM2)
PRELOAD = (
    "torch",
    "transformers",
    "transformers.generation.utils",
    "transformers.masking_utils",
    "transformers.tokenization_utils_base",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
)


@dataclass
class Completed:  # what subprocess.run returns, as far as the tests read it
    returncode: int
    stdout: str
    stderr: str


class PlainPython:
    """One pre-imported Python that runs programs as `python [-m] ARGV...` would, one at a time."""

    def __init__(self) -> None:
        self.fds, theirs = socket.socketpair()  # the child's pipes go over this one (SCM_RIGHTS)
        from kvtui.engine.records.child import openmp_wait

        self.process = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(theirs.fileno())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            pass_fds=(theirs.fileno(),),
            # OpenMP reads its waiting policy once, when torch loads: the engine's, as an engine process gets it
            env={**os.environ, **openmp_wait()},
        )
        theirs.close()
        self.folder: Path | None = None
        self.pid = 0

    def start(self, argv: list, cwd: Path | str, stdin: str, module: bool, env: dict | None) -> None:
        assert self.folder is None, "one run at a time"
        self.folder = Path(tempfile.mkdtemp(prefix="plain-"))
        (self.folder / "stdin").write_text(stdin)
        request = {"argv": [str(a) for a in argv], "cwd": str(cwd), "folder": str(self.folder), "module": module}
        # as subprocess does: the child's environment is this process's now (or the one given)
        request["env"] = {str(k): str(v) for k, v in (os.environ if env is None else env).items()}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        self.pid = json.loads(self._line())["pid"]

    def wait(self, timeout: float | None) -> Completed:
        assert self.folder is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:  # as subprocess.run's timeout: the child killed, then TimeoutExpired
            os.kill(self.pid, signal.SIGKILL)
        code = json.loads(self._line())["returncode"]
        folder, self.folder = self.folder, None
        out, err = ((folder / name).read_text(errors="replace") for name in ("stdout", "stderr"))
        shutil.rmtree(folder)
        if not ready:
            raise subprocess.TimeoutExpired(str(folder), timeout or 0, out, err)
        return Completed(code, out, err)

    def fork(self, argv: list, cwd: str, env: dict, fds: list[int], fd_args: list[int], session: bool) -> int:
        """Begin `python -m ARGV...` with `fds` as its 0, 1, 2 and then `fd_args` (fd numbers in ARGV, given as
        the numbers of fds[3:] there); its pid. `exited()` waits for its code."""
        request = {"argv": argv, "cwd": cwd, "env": env, "module": True, "fds": len(fds), "fd_args": fd_args}
        request["session"] = session
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        socket.send_fds(self.fds, [b"f"], fds)
        self.pid = json.loads(self._line())["pid"]
        return self.pid

    def exited(self) -> int:
        """(after fork) The child's exit code, as Popen gives it (-N: killed by signal N), once it ended."""
        return json.loads(self._line())["returncode"]

    def _line(self) -> str:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the pre-imported Python ended (exit {self.process.poll()})")
        return line

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(30)
        self.fds.close()


class PlainPythons:
    """As many pre-imported Pythons as runs at once (a test's plain and watched runs side by side)."""

    def __init__(self) -> None:
        self.idle: list[PlainPython] = []
        self.all: list[PlainPython] = []

    def start(
        self, argv: list, cwd: Path | str = ".", stdin: str = "", module: bool = False, env: dict | None = None
    ) -> Run:
        """Begin `python ARGV...` (`python -m ARGV...` with module): returns at once, `wait` collects it. `env`:
        the child's whole environment, else this process's (a variable torch or transformers read at import keeps
        its value from when the pre-imported Python started)."""
        python = self.take()
        try:
            python.start(argv, cwd, stdin, module, env)
        except BaseException:
            self.idle.append(python)
            raise
        return Run(self, python)

    def take(self) -> PlainPython:
        """An idle pre-imported Python (a new one when none is); the caller puts it back in `idle` after its run."""
        if self.idle:
            return self.idle.pop()
        python = PlainPython()
        self.all.append(python)
        return python

    def run(
        self,
        argv: list,
        cwd: Path | str = ".",
        stdin: str = "",
        module: bool = False,
        env: dict | None = None,
        timeout: float | None = None,
    ) -> Completed:
        return self.start(argv, cwd, stdin, module, env).wait(timeout)

    def close(self) -> None:
        for python in self.all:
            python.close()
        self.all.clear()
        self.idle.clear()


@dataclass
class Run:
    pool: PlainPythons
    python: PlainPython

    def wait(self, timeout: float | None = None) -> Completed:
        try:
            return self.python.wait(timeout)
        finally:
            self.pool.idle.append(self.python)


_POOL: PlainPythons | None = None


def pythons() -> PlainPythons:
    """This test process's pool (started on first use, closed at its exit)."""
    global _POOL
    if _POOL is None:
        _POOL = PlainPythons()
        atexit.register(_POOL.close)
    return _POOL


class Forked:
    """What ChildSource reads of a subprocess.Popen, for a child a PlainPython forked (not this process's child:
    its PlainPython reaps it and says its code)."""

    def __init__(self, args: list, pid: int, stdin, stdout, stderr) -> None:
        self.args, self.pid = args, pid
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None
        self._ended = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _pipe_end(spec, read: bool, theirs: list[int], mine: list):
    """One of stdin/stdout/stderr as Popen takes it (PIPE, DEVNULL, None): the child's fd (appended to `theirs`)
    and this side's file object (None unless PIPE)."""
    if spec == subprocess.PIPE:
        r, w = os.pipe()
        child, parent = (r, w) if read else (w, r)
        theirs.append(child)
        mine.append(child)  # closed here once handed over
        return os.fdopen(parent, "wb" if read else "rb")
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDONLY if read else os.O_WRONLY)
        theirs.append(fd)
        mine.append(fd)
        return None
    assert spec is None, f"the forked engine takes PIPE, DEVNULL or None, not {spec!r}"
    theirs.append(0 if read else (1 if len(theirs) == 1 else 2))
    return None


FORKED_MODULES = ("kvtui.engine.chat.host",)


def popen_forking_engines(command, *, pass_fds=(), stdin=None, stdout=None, stderr=None, env=None, cwd=None,
                          start_new_session=False, **rest):  # fmt: skip
    """subprocess.Popen, but `python -m kvtui.engine.chat.host ...` forks from a pre-imported Python."""
    if rest or list(command[:2]) != [sys.executable, "-m"] or command[2] not in FORKED_MODULES:
        return subprocess.Popen(
            command, pass_fds=pass_fds, stdin=stdin, stdout=stdout, stderr=stderr, env=env, cwd=cwd,
            start_new_session=start_new_session, **rest,
        )  # fmt: skip
    theirs: list[int] = []
    handed: list[int] = []
    files = [_pipe_end(stdin, True, theirs, handed), _pipe_end(stdout, False, theirs, handed)]
    files.append(_pipe_end(stderr, False, theirs, handed))
    pool = pythons()
    python = pool.take()
    try:
        environment = {str(k): str(v) for k, v in (os.environ if env is None else env).items()}
        pid = python.fork(
            [str(a) for a in command[2:]], cwd or os.getcwd(), environment, [*theirs, *pass_fds], list(pass_fds),
            start_new_session,
        )  # fmt: skip
    except BaseException:
        pool.idle.append(python)
        raise
    finally:
        for fd in handed:
            os.close(fd)
    process = Forked(list(command), pid, *files)

    def reap() -> None:
        try:
            process.returncode = python.exited()
        finally:
            pool.idle.append(python)
            process._ended.set()

    threading.Thread(target=reap, daemon=True, name="forked-engine-reaper").start()
    return process


def run_kvtui(*args, cwd: Path | str = ".", stdin: str = "", env: dict | None = None, timeout: float = 600):
    """`python -m kvtui.cli ARGS...` from a pre-imported Python."""
    return pythons().run(["kvtui.cli", *args], cwd=cwd, stdin=stdin, module=True, env=env, timeout=timeout)


# ---- the pre-imported side ----------------------------------------------------------------------------------


def _exit_code(error: BaseException | None) -> int:
    """What the interpreter exits with after the main script raised `error` (None: it returned)."""
    import traceback

    if error is None:
        return 0
    if isinstance(error, SystemExit):
        if error.code is None:
            return 0
        if isinstance(error.code, int):
            return error.code & 0xFF
        print(error.code, file=sys.stderr)
        return 1
    traceback.print_exception(error)
    return 1


def _child(request: dict, fds: list[int]) -> None:
    """In the forked child: become `python ARGV...` and never return. `fds`: its 0, 1, 2 and the fds named in
    its arguments (request["fd_args"]: their numbers there, in order), else its 0-2 are the run folder's files."""
    import atexit
    import runpy
    import threading

    if request.get("session"):
        os.setsid()
    if fds:
        for fd, given in enumerate(fds[:3]):
            os.dup2(given, fd)
        for given in set(fds[:3]) - {0, 1, 2}:  # the copies received: the child keeps only its 0-2
            os.close(given)
        numbers = {str(number): str(fd) for number, fd in zip(request["fd_args"], fds[3:], strict=True)}
        argv = request["argv"]
        request["argv"] = [numbers.get(a, a) if i and argv[i - 1].endswith("-fd") else a for i, a in enumerate(argv)]
    else:
        folder = Path(request["folder"])
        for fd, name, flags in ((0, "stdin", os.O_RDONLY), (1, "stdout", os.O_WRONLY), (2, "stderr", os.O_WRONLY)):
            opened = os.open(folder / name, flags | (os.O_CREAT | os.O_TRUNC if fd else 0), 0o644)
            os.dup2(opened, fd)
            os.close(opened)
    sys.stdin = sys.__stdin__ = open(0, closefd=False)  # noqa: SIM115 - the zygote's read ahead on fd 0
    if request["env"].get("PYTHONUNBUFFERED"):  # as `python -u`: each write goes out at once
        for fd, name in ((1, "stdout"), (2, "stderr")):
            stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True, line_buffering=True)
            setattr(sys, name, stream)
            setattr(sys, f"__{name}__", stream)
    os.environ.clear()
    os.environ.update(request["env"])
    if request["env"].get("OMP_NUM_THREADS", "").isdigit():  # OpenMP read it when torch loaded: as a start would
        import torch

        torch.set_num_threads(int(request["env"]["OMP_NUM_THREADS"]))
    os.chdir(request["cwd"])
    program, *args = request["argv"]
    sys.argv = [program, *args]
    # `python -m MODULE`: the current directory first on sys.path; `python PROGRAM`: the program's directory
    sys.path[0] = os.getcwd() if request["module"] else os.path.dirname(os.path.abspath(program))
    # then PYTHONPATH's entries, as the interpreter puts them (those the pre-imported Python lacks)
    missing = [e for e in request["env"].get("PYTHONPATH", "").split(os.pathsep) if e and e not in sys.path]
    sys.path[1:1] = missing
    error: BaseException | None = None
    try:
        if request["module"]:
            runpy.run_module(program, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(program, run_name="__main__")
    except BaseException as raised:  # noqa: BLE001 - the interpreter's own top level
        error = raised
    code = _exit_code(error)
    try:  # the interpreter's finalization, in its order
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    finally:
        os._exit(code)


def serve(fds_socket: int) -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    handover = socket.socket(fileno=fds_socket)
    for line in sys.stdin:
        request = json.loads(line)
        fds: list[int] = []
        if request.get("fds"):
            _, fds, _, _ = socket.recv_fds(handover, 1, request["fds"])
        pid = os.fork()
        if pid == 0:
            handover.close()
            _child(request, fds)
        for fd in fds:
            os.close(fd)
        os.write(1, (json.dumps({"pid": pid}) + "\n").encode())
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        os.write(1, (json.dumps({"returncode": code}) + "\n").encode())


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    serve(int(sys.argv[2]))

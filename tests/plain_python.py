"""The plain half of a plain-vs-watched test, run without paying for `import torch, transformers` every time.

A fresh Python spends ~8 s of CPU here importing torch and transformers before a tiny program's first line, and
under a whole suite's load several times that: the plain run of a corpus program was half of its test. A
`PlainPython` is one Python (per test process and environment) that imported them once and forks a child per
program: the child points fds 0-2 at the run's files, runs the script as `python PROGRAM ARGS...` would (argv,
sys.path[0], `__main__`, cwd), then ends as the interpreter ends (non-daemon threads joined, atexit handlers,
streams flushed; a SystemExit's code, or a traceback and 1). A run measured here: 0.6 s instead of 9 s.

Only the reference run goes through here; the watched run stays a real `python -m kvtui.cli watch` process, so a
difference between this emulation and a real interpreter could only make a test fail, never pass.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
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
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
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

    def _line(self) -> str:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the pre-imported Python ended (exit {self.process.poll()})")
        return line

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(30)


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
        if not self.idle:
            self.all.append(PlainPython())
            self.idle.append(self.all[-1])
        python = self.idle.pop()
        try:
            python.start(argv, cwd, stdin, module, env)
        except BaseException:
            self.idle.append(python)
            raise
        return Run(self, python)

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


def _child(request: dict) -> None:
    """In the forked child: become `python ARGV...` and never return."""
    import atexit
    import runpy
    import threading

    folder = Path(request["folder"])
    for fd, name, flags in ((0, "stdin", os.O_RDONLY), (1, "stdout", os.O_WRONLY), (2, "stderr", os.O_WRONLY)):
        opened = os.open(folder / name, flags | (os.O_CREAT | os.O_TRUNC if fd else 0), 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = sys.__stdin__ = open(0, closefd=False)  # noqa: SIM115 - the zygote's read ahead on fd 0
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


def serve() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        os.write(1, (json.dumps({"pid": pid}) + "\n").encode())
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        os.write(1, (json.dumps({"returncode": code}) + "\n").encode())


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    serve()

"""Run a user's program (a script path or `-m module`) as `python` would, and return its exit code.

As `python PROG` / `python -m MOD` have them: a fresh `__main__` module (its `__file__` absolute, its loader, no
`__package__`, the builtins module), `sys.argv`, `sys.path[0]`, the compiler flags (none of kvtui's `from __future__`
imports), and an uncaught exception handed to the program's own `sys.excepthook` with a traceback that starts where
python's does (kvtui's frames left out). Its argv, sys.path, `__main__` and warning filters are taken back after it."""

from __future__ import annotations

import builtins
import os
import runpy
import sys
import threading
import traceback
import types
import warnings
from importlib.machinery import SourceFileLoader


def run_program(target: str, args: list[str], module: bool = False) -> int:
    """Run it in this interpreter with its own argv and `__main__`; an uncaught exception goes to
    `sys.excepthook` as python hands it (exit 1; ctrl+c: 130, 128 + SIGINT). Returns once its threads that are
    not daemons have ended too, as python exits only then (their forwards are watched to the last)."""
    saved_argv, saved_path, saved_main = sys.argv[:], sys.path[:], sys.modules.get("__main__")
    main = sys.modules["__main__"] = _fresh_main()
    before = _Before()
    try:
        with warnings.catch_warnings():  # the program's filters are its own (kvtui's report runs after it)
            code = _run(target, args, module, main)
            try:
                _shut_down(before)
            except KeyboardInterrupt as exc:  # ctrl+c while python would wait for them
                _uncaught(exc)
                code = 130
        return code
    finally:
        sys.argv[:], sys.path[:] = saved_argv, saved_path
        if saved_main is not None:
            sys.modules["__main__"] = saved_main
        sys.stdout.flush()
        sys.stderr.flush()


def _run(target: str, args: list[str], module: bool, main: types.ModuleType) -> int:
    """The program's main thread, to its end: its exit code."""
    try:
        sys.argv = [target, *args]
        if module:  # python -m's own entry: the module's file becomes argv[0], its code runs in `main`
            sys.path.insert(0, os.getcwd())
            runpy._run_module_as_main(target)  # type: ignore[attr-defined]
        elif os.path.isfile(target) and not target.endswith((".pyc", ".pyz", ".zip")):
            sys.path.insert(0, os.path.dirname(os.path.realpath(target)))  # a linked script: its real folder
            _run_source(target, main)
        else:  # a folder or archive with a __main__.py (or a compiled file): runpy, as python itself
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
        return 0
    except SystemExit as exc:
        return _exit_code(exc.code)
    except BaseException as exc:  # noqa: BLE001  the program's own error: reported as python reports it
        _uncaught(exc)
        return 130 if isinstance(exc, KeyboardInterrupt) else 1


class _Before:
    """What this interpreter had before the program ran (kvtui's threads, or a host process's when kvtui runs a
    program in it): python's shutdown is the program's own threads' business, not theirs."""

    def __init__(self):
        self.threads = set(threading.enumerate())
        self.atexits = len(_ATEXITS)


_ATEXITS: list = getattr(threading, "_threading_atexits", [])  # python's callbacks before it joins threads


def _shut_down(before: _Before) -> None:
    """What python does after the main thread's code ends (threading._shutdown), for the program's threads: its
    exit callbacks first (concurrent.futures' stop the pool threads the program left open once their queued work is
    done: an executor never shut down does not hold python), then it waits until no thread that is not a daemon is
    left, those they start too (kvtui's own are daemons)."""
    _stop_pools(before.threads)
    for callback in reversed(_ATEXITS[before.atexits :]):  # those of modules the program imported first
        try:
            callback()
        except Exception:  # noqa: BLE001  python prints it and goes on shutting down
            traceback.print_exc()
    del _ATEXITS[before.atexits :]
    while pending := [
        t
        for t in threading.enumerate()
        if t not in before.threads and not t.daemon and t.is_alive() and t is not threading.current_thread()
    ]:
        for thread in pending:
            thread.join()


# concurrent.futures' exit callbacks, for the threads the program started only (a host process's pools, when kvtui
# runs a program in it, go on working): (module, its shutdown flag, its live threads -> what wakes one)
_POOLS = (
    ("concurrent.futures.thread", "_shutdown", "_threads_queues", lambda queue: queue.put(None)),
    ("concurrent.futures.process", "_global_shutdown", "_threads_wakeups", lambda wakeup: wakeup.wakeup()),
)


def _stop_pools(earlier: set) -> None:
    """Each pool thread the program started told to stop after its queued work (the module's flag a woken thread
    checks, set as its `_python_exit` sets it), and joined; the flag then as it was."""
    for name, flag, registry, wake in _POOLS:
        module = sys.modules.get(name)
        threads = getattr(module, registry, None)
        if threads is None or not hasattr(module, flag):
            continue
        started = [(thread, waker) for thread, waker in list(threads.items()) if thread not in earlier]
        if not started:
            continue
        was = getattr(module, flag)
        setattr(module, flag, True)
        try:
            for _, waker in started:
                wake(waker)
            for thread, _ in started:
                thread.join()
        finally:
            setattr(module, flag, was)


def _fresh_main() -> types.ModuleType:
    """The `__main__` module python starts a program in: name, doc, no package or spec, empty annotations."""
    main = types.ModuleType("__main__")
    main.__annotations__ = {}
    main.__builtins__ = builtins  # type: ignore[attr-defined]  # the module, as in python's __main__ (not its dict)
    return main


def _run_source(target: str, main: types.ModuleType) -> None:
    """A source file as python runs it: named by its absolute path (python 3.9+; not normalised, as python's:
    `sub/../x.py` stays so), with its own compiler flags only."""
    path = target if os.path.isabs(target) else os.path.join(os.getcwd(), target)
    with open(path, "rb") as handle:  # bytes: the file's own coding cookie decides
        source = handle.read()
    code = compile(source, path, "exec", dont_inherit=True)
    main.__file__, main.__cached__ = path, None  # type: ignore[attr-defined]
    main.__loader__ = SourceFileLoader("__main__", path)
    exec(code, main.__dict__)  # noqa: S102  (the user's program, run as python runs it)


_OWN_FRAMES = {_run.__code__, _run_source.__code__}


def _uncaught(exc: BaseException) -> None:
    """The program's sys.excepthook with what python would pass it: the traceback from the program's first frame
    (under -m, runpy's, as python's own -m shows)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code in _OWN_FRAMES:
        tb = tb.tb_next
    exc.__traceback__ = tb
    try:
        sys.excepthook(type(exc), exc, tb)
    except BaseException as hook_error:  # noqa: BLE001  python's words for a hook that fails, then its own report
        print("Error in sys.excepthook:", file=sys.stderr)
        sys.__excepthook__(type(hook_error), hook_error, hook_error.__traceback__)
        print("\nOriginal exception was:", file=sys.stderr)
        sys.__excepthook__(type(exc), exc, tb)


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message") prints it and exits 1
    return 1

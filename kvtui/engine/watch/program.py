"""Run a user's program (a script path or `-m module`) as `python` would, and return its exit code."""

from __future__ import annotations

import os
import runpy
import sys
import traceback


def run_program(target: str, args: list[str], module: bool = False) -> int:
    """Run it in this interpreter with its own argv; an uncaught exception prints its traceback (exit 1)."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    try:
        if module:
            sys.argv = [target, *args]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *args]
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
        return 0
    except SystemExit as exc:
        return _exit_code(exc.code)
    except KeyboardInterrupt:  # ctrl+c: python prints the traceback and exits 130 (128 + SIGINT)
        traceback.print_exc()
        return 130
    except BaseException:  # noqa: BLE001  the program's own error: shown as python shows it
        traceback.print_exc()
        return 1
    finally:
        sys.argv[:], sys.path[:] = saved_argv, saved_path
        sys.stdout.flush()
        sys.stderr.flush()


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message") prints it and exits 1
    return 1

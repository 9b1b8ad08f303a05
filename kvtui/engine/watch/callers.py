"""Which line of the program called: stack walks that skip torch's, transformers' and kvtui's own frames."""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
from types import FrameType

import torch

from .patches import started_at

# kvtui's engine (this file is kvtui/engine/watch/callers.py): its frames are never the program's. Not all of
# kvtui/: the sample programs in kvtui/data/samples are programs, and their lines are the ones to name
_KVTUI_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIBRARY_DIRS = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, _KVTUI_DIR)


def library_dirs() -> tuple[str, ...]:
    import transformers

    extra = [
        os.path.dirname(os.path.abspath(transformers.__file__)) + os.sep,
        os.path.dirname(inspect.__file__) + os.sep,
        os.path.dirname(threading.__file__) + os.sep + "threading.py",
    ]
    return _LIBRARY_DIRS + tuple(extra)


def caller_line(skip: tuple[str, ...] | None = None) -> str:
    """ "file.py:42": the innermost frame that belongs to the user's code, not to torch/transformers/kvtui."""
    skip = skip or library_dirs()
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(skip) and not name.startswith("<frozen"):
            return f"{_short_path(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


GENERATE_CODES: set = set()  # code objects of the watched models' generate(): their frames hold the prompt


def caller_and_generate(skip: tuple[str, ...], start: FrameType | None = None) -> tuple[str, list]:
    """The user's line (as caller_line) and the generate() frames between it and here (or `start`, a frame of
    this stack), innermost first. generate() is read from its frame, not wrapped: a wrapper would become the
    caller that its warnings (stacklevel) point at, and the program's stderr would change."""
    frame: FrameType | None = start if start is not None else sys._getframe(1)
    user = _USER_CODES.get(frame.f_code) if frame is not None else None
    if user is not None:  # called from the user's code met before (a hand-written loop): nothing between
        return f"{user[0]}:{frame.f_lineno}{user[1]}", []  # type: ignore[union-attr]
    frames = []
    library = _LIBRARY_CODES.setdefault(skip, set())
    while frame is not None:
        while frame is not None and frame.f_code in library:  # frames met before: two lines each
            if frame.f_code in GENERATE_CODES:
                frames.append(frame)
            frame = frame.f_back
        if frame is None:
            break
        code = frame.f_code
        user = _USER_CODES.get(code)  # (its short path, " in fixture NAME" or ""): the user's code met before
        if user is None and not code.co_filename.startswith(skip) and not code.co_filename.startswith("<frozen"):
            user = _user_code(code, frame.f_globals)
        if user is not None:
            return f"{user[0]}:{frame.f_lineno}{user[1]}", frames
        if len(library) >= _LIBRARY_KEPT:  # code made at run time (exec, compiled graphs) never grows it unbounded
            library.clear()
        library.add(code)  # torch's, transformers', kvtui's: looked at again from the set above
        if code in GENERATE_CODES:
            frames.append(frame)
        frame = frame.f_back
    return "?", frames


_LIBRARY_CODES: dict[tuple[str, ...], set] = {}  # per tuple of library folders: code objects of frames in them
_LIBRARY_KEPT = 4096


_USER_CODES: dict = {}  # the user's code objects met: code -> (short path, " in fixture NAME" or "")


def _user_code(code, module_globals: dict) -> tuple[str, str]:
    """A user's function as a caller names it, once per function: its short path, and " in fixture NAME" when it
    is a pytest fixture (a session-scoped fixture that tokenizes is where "prompt of 862 tokens, cache of 863"
    hides)."""
    definition = module_globals.get(code.co_name) if "pytest" in sys.modules else None
    is_fixture = (
        type(definition).__name__ == "FixtureFunctionDefinition"  # pytest >= 8.4
        or hasattr(definition, "_pytestfixturefunction")
    )  # older pytest marks the function
    if len(_USER_CODES) >= _LIBRARY_KEPT:  # code made at run time (exec'd programs) never grows it unbounded
        _USER_CODES.clear()
    found = _USER_CODES[code] = (_short_path(code.co_filename), f" in fixture {code.co_name}" if is_fixture else "")
    return found


def thread_caller(line: str) -> tuple[str, str | None]:
    """(caller, thread): on another thread than the main one, its name; with no program frame on its
    stack, the caller names the thread and the line that started it."""
    thread = threading.current_thread()
    if thread is threading.main_thread():
        return line, None
    where = started_at(thread)
    name = thread.name + (f", started at {where}" if where else "")
    return (name if line == "?" else line), name


@functools.lru_cache(maxsize=1024)
def _short_path(path: str) -> str:
    """Relative to the working directory when kvtui first met the file (a getcwd per forward adds up)."""
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return path
    return relative if not relative.startswith("..") else path


def inside_transformers() -> bool:
    """Whether the code that called a cache's edit method is transformers itself (generate's beam search)."""
    import transformers

    root = os.path.dirname(os.path.abspath(transformers.__file__)) + os.sep
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_KVTUI_DIR):  # kvtui's wrapper frames
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(root)

"""What every model source shares: the one-line load error, progress reporting, the cache root.

No textual/rich here (the engine runs headless); torch-free so the CLI can name errors cheaply.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import platformdirs

Progress = Callable[[str, "float | None"], None]

CACHE_ENV = "KVTUI_CACHE_DIR"


class ModelLoadError(Exception):
    """One clear line for the user, e.g. 'model path /x does not exist'."""


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0].strip() if text else ""
    return line or type(exc).__name__


def report(progress: Progress | None, message: str, fraction: float | None) -> None:
    if progress is not None:
        progress(message, fraction)


def scaled(progress: Progress | None, lo: float, hi: float) -> Progress | None:
    """Map a sub-task's 0..1 fractions into lo..hi of the caller's bar."""
    if progress is None:
        return None

    def inner(message: str, fraction: float | None) -> None:
        progress(message, None if fraction is None else lo + (hi - lo) * fraction)

    return inner


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """Silence transformers' own tqdm bars (they would scribble over a TUI)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if was_enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def cache_root() -> Path:
    """``$KVTUI_CACHE_DIR`` if set, else the platform user cache dir for kvtui."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_cache_dir("kvtui"))

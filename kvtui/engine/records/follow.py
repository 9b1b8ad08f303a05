"""A trace still being written, as a source of records (`kvtui replay --follow`).

The program that writes the trace may not have created it yet (it is waited for), and may be run again,
which rewrites the file from the top (truncated in place or replaced by a new file): reading on from the
old offset would land in the middle of a line of the new file, or on a line boundary of it, past the new
run's first steps. When the reader finds no new line, when new bytes come after a wait, and every poll
interval while it catches up, it checks that the file is still the one it read (same inode, not shorter
than what was read, the same first line and the same last line read where they were); when it is not, it
says so and starts again from the top. (A rerun that wrote the very same bytes as far as the reader got
cannot be told apart, and reading on gives the same records.)
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

# Records of this type are the follower's own, not the trace's: {"type": FOLLOW, "what": WAITING | REWRITTEN,
# "message": ...}. A reader starts a fresh replay on REWRITTEN.
FOLLOW = "follow"
WAITING = "waiting"
REWRITTEN = "rewritten"


class FollowSource:
    """A trace file that another process is still writing (`kvtui replay --follow`): its records, then
    new ones as they are appended. Read-only: it takes no commands."""

    supports: set[str] = set()

    def __init__(self, path: str | os.PathLike, poll: float = 0.2):
        self.path, self.poll = Path(path), poll

    def records(self, stop: threading.Event | None = None) -> Iterator[dict]:
        """The trace's records in file order, with the follower's own (FOLLOW) records among them: WAITING
        while the file does not exist, REWRITTEN when it was truncated or replaced (what follows is read from
        its top)."""
        from .trace import TraceError

        waiting = False
        while not _stopped(stop):
            try:
                handle = open(self.path, "rb")
            except FileNotFoundError:
                if not waiting:  # said once per wait
                    waiting = True
                    yield {"type": FOLLOW, "what": WAITING, "message": f"waiting for {self.path}"}
                time.sleep(self.poll)
                continue
            except OSError as exc:
                raise TraceError(f"{self.path}: cannot read: {exc.strerror or exc}") from None
            waiting = False
            with handle:
                rewritten = yield from self._read(handle, stop)
            if not rewritten:
                return
            yield {
                "type": FOLLOW,
                "what": REWRITTEN,
                "message": f"{self.path} was rewritten (truncated or replaced): following it again from the top",
            }

    def _read(self, handle, stop: threading.Event | None):
        """Yield the records of one version of the file; return True when the file was rewritten under us."""
        from .trace import TraceError

        pending = b""
        number = 0
        first = b""  # the file's first line, as read
        last = (0, b"")  # the offset and bytes of the last whole line read
        offset = 0  # the end of the last whole line read
        checked = time.monotonic()
        while not _stopped(stop):
            chunk = handle.readline()
            if not chunk:
                if self._rewritten(handle, first, last):
                    return True
                checked = 0.0  # idle: the next bytes read are checked first (a rewrite may have brought them)
                time.sleep(self.poll)
                continue
            if time.monotonic() - checked >= self.poll:  # after a wait, and every poll while catching up
                checked = time.monotonic()
                if self._rewritten(handle, first, last):
                    return True
            pending += chunk
            if not pending.endswith(b"\n"):  # the writer is mid-line: wait for the rest
                continue
            line, pending = pending, b""
            start, offset = offset, offset + len(line)
            number += 1
            first = first or line
            previous, last = last, (start, line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                # a rewrite that overtook the reader puts it mid-line in the new file: judged by what came before
                if self._rewritten(handle, first if number > 1 else b"", previous):
                    return True
                raise TraceError(f"{self.path}:{number}: not valid JSON") from None
            if isinstance(record, dict) and "type" in record:
                yield record
        return False

    def _rewritten(self, handle, first: bytes, last: tuple[int, bytes]) -> bool:
        """Is the file at self.path no longer the one `handle` read (removed, replaced, truncated, or rewritten
        with other bytes where its first or last read line was)?"""
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            return True  # removed: the next version is waited for
        mine = os.fstat(handle.fileno())
        if (now.st_ino, now.st_dev) != (mine.st_ino, mine.st_dev) or now.st_size < handle.tell():
            return True
        start, line = last
        return _bytes_at(handle, 0, len(first)) != first or _bytes_at(handle, start, len(line)) != line

    def command(self, word: str, argument=None) -> None:
        pass  # read-only (supports nothing: the viewer sends nothing)

    def stop(self) -> None:
        pass


def _bytes_at(handle, offset: int, size: int) -> bytes:
    """`size` bytes of the open file from `offset`, leaving its read position where it was."""
    if not size:
        return b""
    here = handle.tell()
    try:
        handle.seek(offset)
        return handle.read(size)
    finally:
        handle.seek(here)


def _stopped(stop: threading.Event | None) -> bool:
    return stop is not None and stop.is_set()

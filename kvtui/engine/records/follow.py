"""A trace still being written, as a source of records (`kvtui replay --follow`)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path


class FollowSource:
    """A trace file that another process is still writing (`kvtui replay --follow`): its records, then
    new ones as they are appended. Read-only: it takes no commands."""

    supports: set[str] = set()

    def __init__(self, path: str | os.PathLike, poll: float = 0.2):
        self.path, self.poll = Path(path), poll

    def records(self, stop: threading.Event | None = None) -> Iterator[dict]:
        from .trace import TraceError

        try:
            handle = open(self.path, "rb")
        except OSError as exc:
            raise TraceError(f"{self.path}: cannot read: {exc.strerror or exc}") from None
        with handle:
            pending = b""
            number = 0
            while not (stop is not None and stop.is_set()):
                chunk = handle.readline()
                if not chunk:
                    time.sleep(self.poll)
                    continue
                pending += chunk
                if not pending.endswith(b"\n"):  # the writer is mid-line: wait for the rest
                    continue
                line, pending = pending, b""
                number += 1
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    raise TraceError(f"{self.path}:{number}: not valid JSON") from None
                if isinstance(record, dict) and "type" in record:
                    yield record

    def command(self, word: str, argument=None) -> None:
        pass  # read-only (supports nothing: the viewer sends nothing)

    def stop(self) -> None:
        pass

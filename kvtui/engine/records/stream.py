"""The one protocol between a source of steps and a viewer (no Textual, no Rich, no torch): its records and
commands, the `Source` interface, and the pipe a child writes records to. The child processes themselves are
records/child.py (the parent's side) and watch/child.py (a watched program); a growing trace is records/follow.py.

Three sources feed one viewer: kvtui's own chat (the engine process, host.py), a watched
program (`kvtui watch`, a child running it under the probe), and a trace still being written
(`kvtui replay --follow`). Records flow one way as JSON lines: the trace's own records (schema 1)
plus a few stream-only ones; commands flow the other way, one per line: a word, then optionally
one JSON value (`send {"text": "hi", "run": true}`, `rewind 1`, `watch 42`).

  source -> viewer   {"type": "header" | "model" | "step" | "diagnostic", ...}   (trace schema 1)
                     {"type": "output", "stream": "stdout" | "stderr", "text": ..., ["partial": true]}
                                                              (added by the parent) a line of the child's output;
                                                              `partial`: the line's unterminated tail so far (a
                                                              prompt like input("you> ") writes no newline), shown
                                                              as the current last line and replaced by the next
                                                              record of that stream; a "\r" keeps its last part
                     {"type": "output", "stream": "stdin", "text": ...}   (added by the parent, watch only) a
                                                              line the person sent to the program's stdin, in
                                                              order with its output (a terminal's echo): it ends
                                                              a pending partial line, which is not sent again
                     {"type": "process-exit", "code": N}      the child ended (added by the parent)
    watch only       {"type": "paused", "step": N}            the program waits before its next forward
                     {"type": "break", "step": N, "codes": [...]}  break-on-alarm stopped it after step N
                     {"type": "verify", "step": N, ...}       a verify result (as in traces)
                     {"type": "notice", "text": ...}          a one-line answer to a command
                     {"type": "program-exit", "code": N}      the program ended with exit code N
    engine only      {"type": "progress", "text", "fraction"}  loading (conversion, weights)
                     {"type": "ready", "description", "pid", ...facts}  the model is loaded
                     {"type": "load-failed", "error": ...}    one line saying why
                     {"type": "session", "running", "steps", "turn", "cache_length", ["messages",
                      "messages_from"], ["diagnostics", "diagnostics_from"]}  before each step record: the chat
                                                              around it, where it changed
                     {"type": "state", "done": COMMAND, "note", "severity", "error", "verify",
                      ["messages", "messages_from"], ["diagnostics", "diagnostics_from"], ...facts}
                                                              after each command (error: a worker-error)
                     A list is sent as what changed: `X_from: i` and `X`, the items from index i on (the
                     viewer keeps its first i); absent: unchanged. So a record's bytes follow what a step
                     changed, not the chat's length (ListChanges, ListCopy).
  viewer -> source
    watch            pause | run | step | break on | break off | verify | watch ID | quit
    engine           send {"text", "run"} | step | run | pause | stop | rewind N | rewind_to N |
                     force {"id", "run"} | verify | sampler {...} | reset | export | watch ID |
                     attention LAYER | restore {"tokens", "state"} | quit
    the program's stdin (watch only) is a pipe of its own, not a command: the viewer writes the person's lines
    there (`write_stdin`), closes it for EOF (`close_stdin`), and `interrupt()` sends SIGINT to the program's
    process group, as ctrl+c in a terminal does. kvtui's engine process reads no stdin (/dev/null).

A child notices its viewer is gone (quit, crash or SIGKILL) when its control pipe closes, and exits.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from typing import Any, Protocol

COMMANDS = ("pause", "run", "step", "break on", "break off", "verify", "watch", "quit")
STREAM_ONLY = (
    "paused",
    "break",
    "notice",
    "program-exit",
    "output",
    "process-exit",
    "progress",
    "ready",
    "load-failed",
    "session",
    "state",
)


class Source(Protocol):
    """What a viewer reads and drives, whichever source it is: kvtui's engine process (host.py EngineSource),
    a watched program (ProgramSource) or a command's tree (tree_source.py TreeSource), a trace still being
    written (FollowSource). A watched program's source also takes the person's input: `write_stdin(text)`,
    `close_stdin()`, `interrupt()`."""

    supports: set[str]  # the command words it takes: the viewer enables a key by them

    def records(self, stop: threading.Event | None = None) -> Iterator[dict]:
        """Every record until the source ends (the last one `process-exit` for a process) or `stop` is set."""
        ...

    def command(self, word: str, argument: Any = None) -> None:
        """One command (a word of `supports`, its argument a JSON value); a source that ended ignores it."""
        ...

    def stop(self) -> None:
        """End it (a process and whatever it started) and remove what it left on disk; safe to call twice."""
        ...


def format_command(word: str, argument=None) -> str:
    """One command line: the word, then its argument as one JSON value (no newline inside)."""
    return word if argument is None else f"{word} {json.dumps(argument, ensure_ascii=False)}"


class ListChanges:
    """The sender's side of a list sent as its changes (see the module doc): what changed since the last send."""

    def __init__(self):
        self._sent: list = []

    def changes(self, now: list) -> tuple[int, list] | None:
        """(i, now[i:]) for the first i items the viewer already has; None when nothing changed."""
        same, shortest = 0, min(len(self._sent), len(now))
        while same < shortest and self._sent[same] == now[same]:
            same += 1
        if same == len(now) == len(self._sent):
            return None
        self._sent = [dict(item) if isinstance(item, dict) else item for item in now]  # items mutated in place
        return same, now[same:]

    def put(self, record: dict, key: str, now: list, always: bool = False) -> None:
        """Add `key` and `key_from` to the record when the list changed (or `always`: a state record)."""
        found = self.changes(now)
        if found is None and always:
            found = len(now), []
        if found is not None:
            record[f"{key}_from"], record[key] = found


class ListCopy:
    """The viewer's side: the list as the records built it."""

    def __init__(self):
        self.items: list = []

    def update(self, record: dict, key: str) -> list | None:
        """The whole list when this record changed it (a new list object), else None."""
        if key not in record:
            return None
        self.items = self.items[: record.get(f"{key}_from", 0)] + list(record[key])
        return self.items


def parse_command(line: str) -> tuple[str, Any]:  # the argument: a JSON value
    word, _, rest = line.strip().partition(" ")
    if not rest:
        return word, None
    try:
        return word, json.loads(rest)
    except ValueError:
        return word, rest  # a bare word argument ("break on")


class RecordPipe:
    """The child's end of the record stream: one JSON line per record, in the order sent, serialised by the
    sender (a step once, for the pipe and the trace) and written by a LineWriter's thread (a viewer that
    reads slowly never holds the program)."""

    def __init__(self, fd: int):
        from .trace import LineWriter

        self._writer = LineWriter(
            os.fdopen(fd, "wb", buffering=0), "kvtui-record-pipe", raise_errors=False, background=True
        )

    @property
    def closed(self) -> bool:
        return self._writer.error is not None

    def send(self, *records) -> None:
        """Records (dicts, or step snapshots) written in one go: the viewer's reader wakes once for all of them."""
        self._writer.put(*records)

    def close(self) -> None:
        self._writer.close()

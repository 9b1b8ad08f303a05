"""Trace files: JSON Lines, one header, one line per forward, one buffer line per turn (schema 1).

Written as the session goes and flushed per line on the writing thread, so a crash (SIGKILL too) leaves
every finished step readable.
The reader names the file and line of anything it cannot read, except the crash signature: a last
line with no newline that does not parse is the tail an interrupted writer left, dropped and flagged
(`Trace.truncated`).
"""

from __future__ import annotations

import atexit
import io
import json
import os
import platform
import queue
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import orjson

from . import codec

SCHEMA = 1


class TraceError(Exception):
    """A trace that cannot be read: names the file and the line."""


class TruncatedTailError(TraceError):
    """The last line has no newline and does not parse: a writer was interrupted in the middle of it."""

    def __init__(self, path: Path, number: int):
        self.path, self.number = path, number
        super().__init__(f"{path}:{number}: the last line is truncated (the recording was interrupted mid-line)")


def header_start() -> dict:
    """The first fields of every trace header, whoever records: the type, schema and versions."""
    import torch
    import transformers

    from kvtui._version import __version__

    return {
        "type": "header",
        "schema": SCHEMA,
        "kvtui": __version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def header_record(session, model_source: str, model_path: str) -> dict:
    model, settings = session.model, session.config.sampler
    return {
        **header_start(),
        "model": model_source,
        "model_path": model_path,
        "model_class": type(model).__name__,
        "layers": len(session.cache.layers) if session.cache is not None else 0,  # --cache none: no cache object
        "dtype": session.dtype,
        "device": str(session.device),
        "cache": session.config.cache,
        **(
            {"cache_bits": session.config.cache_bits, "cache_backend": session.config.cache_backend}
            if session.config.cache == "quantized"
            else {}
        ),
        **({"press": session.config.press} if getattr(session.config, "press", None) else {}),
        **({"compile": True} if session.config.compile else {}),
        "capacity": session.capacity,
        "mode": session.config.mode,
        "sampler": {
            "temperature": settings.temperature,
            "top_k": settings.top_k,
            "top_p": settings.top_p,
            "repetition_penalty": settings.repetition_penalty,
        },
        "seed": settings.seed,
    }


def record_line(item) -> bytes:
    """One JSON line: of a record (a dict), or of a step snapshot (codec.step_record, serialised once
    whichever sink asks first: its `line` box keeps the text). orjson: a 30-layer step record is ~13 KB,
    ~200 µs with the json module and ~15 µs with orjson (compact separators, UTF-8 as is)."""
    if isinstance(item, dict):
        return orjson.dumps(item) + b"\n"
    box = item.line
    if not box:
        box.append(orjson.dumps(codec.step_record(item, objects=True)) + b"\n")
    return box[0]


class LineWriter:
    """Writes records as JSON lines, in the order they were put, with one write and one flush per put.

    Records are serialised on the caller's thread (a step once, whichever sink asks first: ~25 µs for a
    3-layer step). A thread of its own did that work before, and cost more than it saved: it needs the
    interpreter lock for the same work, and each hand-over wakes it while the model's thread wants the
    lock back at every torch call (measured on a Python-bound model: a watched step +190 µs with the
    thread, +70 µs written in place).

    A file is written on the caller's thread too: a step is in the operating system's hands before the
    next forward starts, so a SIGKILL loses no finished step (a kill in the middle of a write can leave
    half a line, which the reader drops). A stream (`background=True`: the pipe to a viewer) is written
    by a thread of its own, so a viewer that reads slowly never holds the program; at a kill, lines it
    has not written yet are lost with the viewer's connection anyway.

    An error (disk full, a closed pipe) stops the writing; `error` says which and the next `put` raises
    it (`raise_errors`) or drops silently."""

    def __init__(self, file: IO[bytes], name: str, raise_errors: bool = True, background: bool = False):
        self._file = file
        self._raise = raise_errors
        self.error: BaseException | None = None
        self._open = True
        self._forked = False  # set in a child forked without exec: it inherits this writer, and must not write
        _WRITERS.add(self)
        self._lock = threading.Lock()  # several threads' puts: each one's lines whole and in its order
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()
            atexit.register(self.close)  # a program that exits without closing loses nothing queued

    def put(self, *items) -> None:
        if self.error is not None:
            if self._raise:
                raise self.error
            return
        if not self._open or self._forked:
            return
        data = record_line(items[0]) if len(items) == 1 else b"".join(map(record_line, items))
        if self._queue is not None:
            self._queue.put(data)
            return
        with self._lock:
            if self._open:  # a put racing close() on another thread writes nothing rather than fail
                self._write(data)

    def _write(self, data: bytes) -> None:
        if self.error is not None:
            return
        try:
            _write_through(self._file, data)
        except Exception as exc:  # noqa: BLE001  said at the next put (or dropped: a viewer gone)
            self.error = exc

    def _run(self) -> None:
        assert self._queue is not None
        while True:
            data = self._queue.get()
            if data is None:
                return
            if isinstance(data, threading.Event):  # drain(): everything before it is written
                data.set()
                continue
            self._write(data)

    def drain(self) -> None:
        """Wait until everything put so far is written."""
        if self._queue is not None and self._thread is not None and self._thread.is_alive():
            done = threading.Event()
            self._queue.put(done)
            done.wait()

    def close(self) -> None:
        """Write what is queued, then close the file."""
        with self._lock:
            if not self._open:
                return
            self._open = False
        thread, self._thread = self._thread, None
        if thread is not None:
            atexit.unregister(self.close)
            if thread is not threading.current_thread():
                assert self._queue is not None
                self._queue.put(None)
                thread.join()
        with self._lock:
            try:
                self._file.close()
            except OSError:
                pass


_WRITERS: weakref.WeakSet[LineWriter] = weakref.WeakSet()


def _forked_child() -> None:
    """In a child forked without exec: its copies of the parent's writers go quiet (asking the pid at every
    write instead cost a system call a step, ~3.5 µs after a forward)."""
    for writer in list(_WRITERS):
        writer._forked = True


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forked_child)


def _write_through(file: IO[bytes], data: bytes) -> None:
    """`data` in the operating system's hands when this returns: an unbuffered file in one system call (no
    buffer to copy into and flush), a buffered one written and flushed."""
    if not isinstance(file, io.RawIOBase):
        file.write(data)
        file.flush()
        return
    written = file.write(data)
    if written != len(data):  # an unbuffered write may take part of the bytes (a signal, a full disk)
        _write_rest(file, data, written)


def _write_rest(file: IO[bytes], data: bytes, written: int | None) -> None:
    view = memoryview(data)
    while written:
        view = view[written:]
        if not view:
            return
        written = file.write(view)
    # None (would block) or 0: nothing more can go
    raise OSError(f"wrote {len(data) - len(view)} of {len(data)} bytes")


class TraceWriter:
    """Appends records to a JSON Lines file through a LineWriter (one flush per record, on the caller's
    thread; to a stream, off it). The header is written before the constructor returns."""

    def __init__(self, path: str | os.PathLike | IO[bytes], header: dict, append: bool = False):
        """`append`: go on with a trace another writer started (a restarted engine): no second header.
        `path` may be an open binary stream (a watched process's connection to its viewer): a write that
        fails there stops the writing silently (the viewer is gone), never the program."""
        handle: IO[bytes] | None
        if isinstance(path, (str, os.PathLike)):
            stream, self.path, handle = False, Path(path), None
        else:  # an open binary stream
            stream, self.path, handle = True, Path("<stream>"), path
        try:
            if handle is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                # unbuffered: each line is one system call (after a forward, ~16 µs where a buffered
                # write and flush took ~24), in the operating system's hands when it returns
                handle = open(self.path, "ab" if append else "wb", buffering=0)
            if not append:
                _write_through(handle, record_line(header))
        except OSError as exc:
            raise TraceError(f"{self.path}: cannot write the trace: {exc.strerror or exc}") from exc
        self._writer: LineWriter | None = LineWriter(
            handle, "kvtui-trace-writer", raise_errors=not stream, background=stream
        )

    def write(self, record) -> None:
        """A record (dict) or a step snapshot (serialised once, whichever sink asks first)."""
        if self._writer is None:
            return
        try:
            self._writer.put(record)
        except (OSError, ValueError) as exc:
            raise TraceError(f"{self.path}: cannot write the trace: {exc}") from exc

    def flush(self) -> None:
        """Wait until every record written so far is on disk."""
        if self._writer is not None:
            self._writer.drain()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass
class Trace:
    path: Path
    header: dict
    steps: list[dict] = field(default_factory=list)
    buffers: list[dict] = field(default_factory=list)  # one per turn, in order
    events: list[dict] = field(default_factory=list)  # other record types, kept as they are
    truncated: bool = False  # the writer was interrupted mid-line: that last line was dropped
    truncated_line: int | None = None  # the number of that dropped line


def iter_records(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """(line number, record) for every non-blank line; TraceError naming file:line for a bad one,
    TruncatedTailError (a TraceError) for an unterminated last line that does not parse."""
    path = Path(path)
    try:
        handle = open(path, "rb")  # bytes: a write cut inside a UTF-8 character is still a line
    except FileNotFoundError:
        raise TraceError(f"{path}: no such trace file") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    with handle:
        for number, raw in enumerate(handle, start=1):
            finished = raw.endswith(b"\n")  # only the file's last line can lack one
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                if not finished:
                    raise TruncatedTailError(path, number) from None
                raise TraceError(
                    f"{path}:{number}: not valid UTF-8 ({exc.reason} at byte {exc.start} of the line)"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError) as exc:  # JSONDecodeError, or e.g. an integer too long
                if not finished:
                    raise TruncatedTailError(path, number) from None
                reason = exc.msg if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
                raise TraceError(f"{path}:{number}: not valid JSON ({reason}); the line may be truncated") from None
            if not isinstance(record, dict) or "type" not in record:
                raise TraceError(f"{path}:{number}: a trace record must be an object with a 'type'")
            yield number, record


def read_trace(path: str | os.PathLike, *, strict: bool = False) -> Trace:
    """Every record of a trace. A last line cut short by a crash is dropped and sets `truncated`;
    `strict=True` raises TraceError (file:line) for it instead."""
    trace: Trace | None = None
    try:
        for number, record in iter_records(path):
            kind = record["type"]
            if trace is None:
                if kind != "header":
                    raise TraceError(f"{path}:{number}: the first record must be the header, found {kind!r}")
                if record.get("schema") != SCHEMA:
                    raise TraceError(
                        f"{path}:{number}: unknown trace schema {record.get('schema')!r} (this kvtui reads {SCHEMA})"
                    )
                trace = Trace(Path(path), record)
            elif kind == "step":
                for key in ("step", "input_ids", "positions", "cursor", "cache_seq_length", "layers", "topk"):
                    if key not in record:
                        raise TraceError(f"{path}:{number}: step record lacks {key!r}")
                trace.steps.append(record)
            elif kind == "buffer":
                if not isinstance(record.get("tokens"), list):
                    raise TraceError(f"{path}:{number}: buffer record lacks its 'tokens' list")
                trace.buffers.append(record)
            else:
                trace.events.append(record)
    except TruncatedTailError as exc:
        if strict:
            raise
        if trace is None:
            raise TraceError(
                f"{path}:{exc.number}: the header line is cut short (the recording was interrupted before it started)"
            ) from None
        trace.truncated = True
        trace.truncated_line = exc.number
    if trace is None:
        raise TraceError(f"{path}: empty trace (no header)")
    return trace

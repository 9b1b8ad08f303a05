"""Trace files: JSON Lines, one header, one line per forward, one buffer line per turn (schema 1).

Written as the session goes and flushed per line, so a crash leaves every finished step readable.
The reader names the file and line of anything it cannot read, except the crash signature: a last
line with no newline that does not parse is the tail an interrupted writer left, dropped and flagged
(`Trace.truncated`).
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator

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

    return {"type": "header", "schema": SCHEMA, "kvtui": __version__, "transformers": transformers.__version__,
            "torch": torch.__version__, "python": platform.python_version()}


def header_record(session, model_source: str, model_path: str) -> dict:
    model, settings = session.model, session.config.sampler
    return {
        **header_start(),
        "model": model_source,
        "model_path": model_path,
        "model_class": type(model).__name__,
        "layers": len(session.cache.layers),
        "dtype": session.dtype,
        "device": str(session.device),
        "cache": session.config.cache,
        **({"cache_bits": session.config.cache_bits, "cache_backend": session.config.cache_backend}
           if session.config.cache == "quantized" else {}),
        **({"compile": True} if session.config.compile else {}),
        "capacity": session.capacity,
        "mode": session.config.mode,
        "sampler": {
            "temperature": settings.temperature, "top_k": settings.top_k, "top_p": settings.top_p,
            "repetition_penalty": settings.repetition_penalty,
        },
        "seed": settings.seed,
    }


class TraceWriter:
    """Appends records to a JSON Lines file, one flush per record."""

    def __init__(self, path: str | os.PathLike, header: dict, append: bool = False):
        """`append`: go on with a trace another writer started (a restarted engine): no second header."""
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file: IO[str] | None = open(self.path, "a" if append else "w", encoding="utf-8")
        except OSError as exc:
            raise TraceError(f"{self.path}: cannot write the trace: {exc.strerror or exc}") from exc
        if not append:
            self.write(header)

    def write(self, record: dict) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

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
                raise TraceError(f"{path}:{number}: not valid UTF-8 ({exc.reason} at byte {exc.start} of the line)") from None
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
                    raise TraceError(f"{path}:{number}: unknown trace schema {record.get('schema')!r} (this kvtui reads {SCHEMA})")
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
            raise TraceError(f"{path}:{exc.number}: the header line is cut short "
                             "(the recording was interrupted before it started)") from None
        trace.truncated = True
    if trace is None:
        raise TraceError(f"{path}: empty trace (no header)")
    return trace

"""Trace files: JSON Lines, one header, one line per forward, one buffer line per turn (schema 1).

Written as the session goes and flushed per line, so a crash leaves every finished step readable.
The reader names the file and line of anything it cannot read.
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


def header_record(session, model_source: str, model_path: str) -> dict:
    import torch
    import transformers

    from kvtui import __version__

    model, settings = session.model, session.config.sampler
    return {
        "type": "header",
        "schema": SCHEMA,
        "kvtui": __version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "model": model_source,
        "model_path": model_path,
        "model_class": type(model).__name__,
        "layers": len(session.cache.layers),
        "dtype": session.dtype,
        "device": str(session.device),
        "cache": session.config.cache,
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

    def __init__(self, path: str | os.PathLike, header: dict):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file: IO[str] | None = open(self.path, "w", encoding="utf-8")
        except OSError as exc:
            raise TraceError(f"{self.path}: cannot write the trace: {exc.strerror or exc}") from exc
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


def iter_records(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    path = Path(path)
    try:
        handle = open(path, encoding="utf-8")
    except FileNotFoundError:
        raise TraceError(f"{path}: no such trace file") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    with handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path}:{number}: not valid JSON ({exc.msg}); the line may be truncated") from None
            if not isinstance(record, dict) or "type" not in record:
                raise TraceError(f"{path}:{number}: a trace record must be an object with a 'type'")
            yield number, record


def read_trace(path: str | os.PathLike) -> Trace:
    trace: Trace | None = None
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
    if trace is None:
        raise TraceError(f"{path}: empty trace (no header)")
    return trace

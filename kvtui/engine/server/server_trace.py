"""A server's prefix cache on record: the events as received, the token texts learned, the metrics polled and
the notes raised, one JSON line each (schema 1). `kvtui replay` folds the same events into a fresh PrefixCache
(so it shows the same screens with no server and no tokenizer) and `kvtui diff` compares two runs.

    {"type": "server-header", "schema": 1, "kvtui": ..., "servers": [...], "max_blocks": N, "started": ts}
    {"type": "texts", "pieces": {"7487": "Time", ...}, "special": [1, 2]}    before the batch that needs them
    {"type": "batch", "origin": "host:port", "seq": 7, "ts": ..., "rank": 0, "skipped": 0, "events": [...]}
    {"type": "note", "code": ..., "severity": ..., "message": ..., "batch": ..., ...}    derived; replay re-derives
    {"type": "metrics", "origin": ..., "ts": ..., "queries": ..., "hits": ..., "capacity": ..., "usage": ...}
    {"type": "problem", "origin": ..., "message": ..., "undecodable": bool, "restart": bool}
                                    restart: the origin's publisher restarted (its blocks are gone: replay drops them)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import IO, Any

import orjson

from ..reading.token_texts import TokenTexts
from ..records.codes import current_code
from ..records.snapshot import Diagnostic, Where
from .kv_events import AllCleared, BlocksRemoved, BlocksStored, Event, EventBatch
from .metrics import watched_rate
from .prefix_cache import PrefixCache
from .server_http import CacheMetrics, ServerInfo

SCHEMA = 1
HEADER = "server-header"


class ServerTraceError(Exception):
    """A server trace that cannot be read: names the file and the line."""


def event_record(event: Event) -> dict:
    if isinstance(event, BlocksStored):
        return {
            "type": "stored",
            "hashes": list(event.hashes),
            "parent": event.parent,
            "tokens": list(event.token_ids),
            "block_size": event.block_size,
            "group": event.group,
            "medium": event.medium,
            "lora": event.lora,
            "kind": event.kind,
            **({"extra": list(event.extra)} if event.extra else {}),
            **({"session": event.session} if event.session is not None else {}),
        }
    if isinstance(event, BlocksRemoved):
        return {"type": "removed", "hashes": list(event.hashes), "group": event.group, "medium": event.medium}
    return {"type": "cleared"}


def event_from_record(record: dict) -> Event:
    kind = record["type"]
    if kind == "stored":
        return BlocksStored(
            hashes=tuple(record["hashes"]),
            parent=record.get("parent"),
            token_ids=tuple(record["tokens"]),
            block_size=int(record["block_size"]),
            group=int(record.get("group") or 0),
            medium=record.get("medium"),
            lora=record.get("lora"),
            kind=record.get("kind"),
            extra=tuple(record.get("extra") or ()),
            session=record.get("session"),
        )
    if kind == "removed":
        return BlocksRemoved(hashes=tuple(record["hashes"]), group=record.get("group"), medium=record.get("medium"))
    if kind == "cleared":
        return AllCleared()
    raise ValueError(f"an event of type {kind!r}")


def batch_record(origin: str, batch: EventBatch) -> dict:
    return {
        "type": "batch",
        "origin": origin,
        "seq": batch.seq,
        "ts": batch.ts,
        "rank": batch.dp_rank,
        "skipped": batch.skipped,
        "events": [event_record(e) for e in batch.events],
        **({"caught_up": True} if batch.caught_up else {}),
    }


def note_record(note: Diagnostic) -> dict:
    where = note.where or Where()
    return {
        "type": "note",
        "code": note.code,
        "severity": note.severity,
        "message": note.message,
        "batch": note.step,
        "origin": where.origin,
        "chain": where.chain,
        "position": where.position,
        "block": where.block,
    }


def server_record(info: ServerInfo) -> dict:
    return {
        "url": info.url,
        "model": info.model,
        "root": info.root,
        "endpoints": [asdict(e) for e in info.endpoints],
    }


class ServerTraceWriter:
    """Writes a server trace as the viewer receives it: one line per record, flushed (a crash loses nothing
    finished). Thread-safe: the subscriber's thread writes batches, the metrics poller its samples."""

    def __init__(self, path: Path, servers: list[ServerInfo], cache: PrefixCache):
        self.path = Path(path)
        self._file: IO[bytes] = open(self.path, "wb")  # noqa: SIM115  (closed by close())
        self._lock = threading.Lock()
        self._cache = cache
        self._special_written: set[int] = set()
        self._put(
            {
                "type": HEADER,
                "schema": SCHEMA,
                "kvtui": _version(),
                "servers": [server_record(s) for s in servers],
                "max_blocks": cache.max_blocks,
                "started": time.time(),
            }
        )

    def _put(self, record: dict) -> None:
        with self._lock:
            if self._file.closed:
                return
            self._file.write(orjson.dumps(record, option=orjson.OPT_NON_STR_KEYS) + b"\n")
            self._file.flush()

    def batch(self, origin: str, batch: EventBatch, notes: list[Diagnostic]) -> None:
        texts = self._cache.texts
        fresh = texts.take_fresh()
        special = texts.special - self._special_written
        if fresh or special:
            self._special_written |= special
            self._put({"type": "texts", "pieces": {str(k): v for k, v in fresh.items()}, "special": sorted(special)})
        self._put(batch_record(origin, batch))
        for note in notes:
            self._put(note_record(note))

    def metrics(self, origin: str, ts: float, metrics: CacheMetrics, notes: Sequence[Diagnostic] = ()) -> None:
        self._put({"type": "metrics", "origin": origin, "ts": ts, **asdict(metrics)})
        for note in notes:  # raised by the metric rules on this poll (a replay re-derives them)
            self._put(note_record(note))

    def problem(self, origin: str, message: str, undecodable: bool = False, restart: bool = False) -> None:
        record = {"type": "problem", "origin": origin, "message": message, "undecodable": undecodable}
        if restart:
            record["restart"] = True
        self._put(record)

    def close(self) -> None:
        with self._lock:
            self._file.close()


def _version() -> str:
    from kvtui._version import __version__

    return __version__


def read_records(path: Path) -> Iterator[dict]:
    """The trace's records, the header first (ServerTraceError names the line it cannot read; a last line cut
    short by a killed writer is dropped)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ServerTraceError(f"{path}: {error.strerror or error}") from None
    lines = data.split(b"\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            if number == len(lines) and not data.endswith(b"\n"):
                return  # the tail an interrupted writer left
            raise ServerTraceError(f"{path}:{number}: not a JSON line") from None
        if number == 1 and (not isinstance(record, dict) or record.get("type") != HEADER):
            raise ServerTraceError(f"{path}:1: not a kvtui server trace (no server-header)")
        if not isinstance(record, dict):
            raise ServerTraceError(f"{path}:{number}: not a record")
        yield record


def is_server_trace(path: Path) -> bool:
    try:
        with open(path, "rb") as file:
            first = file.readline()
        return orjson.loads(first).get("type") == HEADER
    except (OSError, orjson.JSONDecodeError, AttributeError):
        return False


@dataclass
class ServerRun:
    """A server trace read back: its header, the prefix cache its events rebuild, and the notes recorded."""

    path: Path
    header: dict
    cache: PrefixCache
    recorded_notes: list[dict] = field(default_factory=list)
    problems: list[dict] = field(default_factory=list)
    batches: int = 0

    @property
    def servers(self) -> list[dict]:
        return list(self.header.get("servers") or [])


def load_server_trace(path: Path, until_batch: int | None = None) -> ServerRun:
    """Replay a server trace into a fresh PrefixCache (up to `until_batch` batches, all by default)."""
    records = read_records(path)
    try:
        header = next(records)
    except StopIteration:
        raise ServerTraceError(f"{path}: empty") from None
    texts = TokenTexts()
    cache = PrefixCache(texts, max_blocks=int(header.get("max_blocks") or 200_000))
    run = ServerRun(Path(path), header, cache)
    for number, record in enumerate(records, 2):
        kind = record.get("type")
        try:
            if kind == "texts":
                texts.learn({int(k): v for k, v in record.get("pieces", {}).items()}, record.get("special", ()))
            elif kind == "batch":
                if until_batch is not None and run.batches >= until_batch:
                    break
                events = tuple(event_from_record(e) for e in record["events"])
                batch = EventBatch(
                    seq=int(record["seq"]),
                    ts=float(record["ts"]),
                    events=events,
                    dp_rank=int(record.get("rank") or 0),
                    skipped=int(record.get("skipped") or 0),
                    caught_up=bool(record.get("caught_up")),
                )
                cache.apply(batch, record["origin"])
                run.batches += 1
            elif kind == "note":  # a code renamed since it was written reads as the code that says it now
                run.recorded_notes.append({**record, "code": current_code(record["code"])})
            elif kind == "metrics":
                cache.record_metrics(record["origin"], record["ts"], _metrics(record))
            elif kind == "problem":
                run.problems.append(record)
                if record.get("undecodable"):
                    cache.stats(record["origin"]).skipped += 1
                if record.get("restart"):
                    cache.restart(record["origin"])
        except (KeyError, TypeError, ValueError) as error:
            raise ServerTraceError(f"{path}:{number}: a {kind} record kvtui cannot read ({error})") from None
    return run


def _metrics(record: dict[str, Any]) -> CacheMetrics:
    return CacheMetrics(**{f.name: record.get(f.name) for f in fields(CacheMetrics) if f.name != "started"})


def _totals(cache: PrefixCache) -> dict[str, float | int | str | None]:
    stats = list(cache.origins.values())
    # the rate over the watched interval: the servers' lifetime counters move between two runs that saw the same events
    watched = [rate[0] for samples in cache.metrics.values() if (rate := watched_rate(samples)) is not None]
    return {
        "batches": sum(s.batches for s in stats),
        "blocks stored": sum(s.stored for s in stats),
        "blocks removed": sum(s.removed for s in stats),
        "blocks held": sum(s.held for s in stats),
        "clears": sum(s.cleared for s in stats),
        "lost batches": sum(s.lost for s in stats),
        "routing waste (tokens)": sum(s.routed_tokens for s in stats),
        "hits reported (tokens)": sum(s.reported_hits for s in stats),
        "hits inferred (tokens)": sum(s.inferred_hits for s in stats),
        "hit rate while watched": f"{sum(watched) / len(watched):.1%}" if watched else None,
    }


def _chains(cache: PrefixCache) -> dict[tuple[int, ...], int]:
    """Each chain held at the end by its first block's tokens (hashes differ between servers: tokens do not)."""
    return {tuple(tops[0].tokens): chain for chain, tops in cache.tops.items() if tops and not tops[0].orphan}


def diff_server_runs(a: ServerRun, b: ServerRun) -> list[str]:
    """What differs between two server runs, as lines (none: they agree): the notes in order, the chains held at
    the end (by their first tokens), the totals."""
    lines = []
    notes_a = [(n.code, n.message) for n in a.cache.notes]
    notes_b = [(n.code, n.message) for n in b.cache.notes]
    for index, (x, y) in enumerate(zip(notes_a, notes_b, strict=False)):
        if x != y:
            lines.append(f"note {index + 1} differs: A {x[0]}: {x[1]}")
            lines.append(f"{' ' * len(f'note {index + 1} differs: ')}B {y[0]}: {y[1]}")
            break
    if len(notes_a) != len(notes_b):
        lines.append(f"notes: A has {len(notes_a)}, B has {len(notes_b)}")
    chains_a, chains_b = _chains(a.cache), _chains(b.cache)
    for name, only, other, cache in (("A", chains_a, chains_b, a.cache), ("B", chains_b, chains_a, b.cache)):
        missing = [tokens for tokens in only if tokens not in other]
        for tokens in missing[:5]:
            lines.append(f"chain only in {name}: #{only[tokens]} {cache.texts.text(tokens[:24])!r}")
        if len(missing) > 5:
            lines.append(f"... {len(missing) - 5} more chains only in {name}")
    totals_a, totals_b = _totals(a.cache), _totals(b.cache)
    for key in totals_a:
        if totals_a[key] != totals_b[key]:
            lines.append(f"{key}: A {totals_a[key]}, B {totals_b[key]}")
    return lines

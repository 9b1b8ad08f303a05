"""Where every cache a watched program uses came from, and what each one holds.

A cache kvtui sees is made by the program (first seen empty), by a forward or generate() that got none,
copied from another watched cache (`copy.deepcopy` / `copy.copy`: the copy starts with its parent's
tokens, origins kept), or filled before kvtui saw it (pickled, loaded, made before attaching): its
earliest tokens are an unknown prefix. Discarded caches leave their ids (bounded, ids only, never
tensors) so a later prefill that re-encodes them is named (`recomputed-prefix`).

Nothing here is stored on the cache: tracks live in a registry keyed by the cache's identity.
"""

from __future__ import annotations

from collections import deque
from copy import deepcopy
from dataclasses import dataclass, field

from ..reading.alarms import Alarms
from ..reading.introspect import Fingerprint
from ..reading.introspect.held import Held, Masked
from ..records.snapshot import BufferToken, unknown_token
from .patches import Registry

DISCARDED_KEPT = 16  # discarded caches whose ids are kept
IDS_KEPT = 8192  # ids kept per discarded cache (row 0)


@dataclass
class CacheTrack:
    """What kvtui knows about one cache object: its name, history and the tokens of each batch row."""

    name: str  # "DynamicCache#3"
    model: int | None  # index of the watched model that used it first
    rows: list[list[BufferToken]]  # [batch][tokens]; a truncation starts a new list (views stay valid)
    made: str = "program"  # program | generate | forward | deepcopy | copy | unknown (filled before kvtui saw it)
    parent: str | None = None
    copied_at: int | None = None  # the parent's length when copied
    unknown: int = 0  # leading tokens kvtui never saw (lowered when the cache is cut below them)
    capacity: int | None = None  # a static cache's slots (fixed for its life); None: it grows
    turn: int = 0  # prefills into this cache whose tokens it still holds (truncate: a cut turn is not counted)
    alarms: Alarms = field(default_factory=Alarms)  # its own repeat state
    fingerprint: Fingerprint | None = None  # after its last forward or edit; spent at the next check
    # after a forward with a 2-D mask: ((its columns, the cache's length after it), attended tokens per row)
    attended: tuple[tuple[int, int], list] | None = None
    held: Held | None = None  # a compressed cache: the positions each layer and head holds (evictions.py)
    masked: Masked | None = None  # keys a press masked per KV head, kept in their slots (masks.py)

    def release(self) -> None:
        """Drop the fingerprint's views of the cache's storage (the cache died, or kvtui detached)."""
        if self.fingerprint is not None:
            self.fingerprint.release()
            self.fingerprint = None

    def ids(self, row: int = 0) -> list[int]:
        return [t.id for t in self.rows[row]] if row < len(self.rows) else []

    def truncate(self, length: int) -> None:
        """The cache now holds `length` tokens (a crop, a reset, an edit seen between forwards).

        A turn is a prefill the cache still holds: the counter goes back to the turn of the last token kept (0:
        none), as kvtui's own chat does at a rewind. So a throwaway forward whose tokens the program discards
        (a warm-up, then `reset()` or `crop`) is not counted, and the next prefill is that turn's successor."""
        for i, row in enumerate(self.rows):
            if len(row) > length:
                self.rows[i] = row[:length]  # a new list: views handed out earlier stay valid
        self.unknown = min(self.unknown, length)
        self.attended = None
        kept = self.rows[0] if self.rows else []
        self.turn = min(self.turn, kept[-1].turn if kept else 0)

    def record(self) -> dict:
        """The trace's `cache` line: a cache kvtui saw for the first time."""
        return {
            "type": "cache",
            "cache_id": self.name,
            "made": self.made,
            "parent": self.parent,
            "copied_at": self.copied_at,
            "unknown_prefix": self.unknown,
            "model": self.model,
        }


class Lineage:
    """Every cache seen, by identity; the ids of discarded ones."""

    def __init__(self):
        self._tracks: Registry[CacheTrack] = Registry()
        self._count = 0
        self.discarded: deque[tuple[str, int | None, tuple[int, ...]]] = deque(maxlen=DISCARDED_KEPT)

    def get(self, cache) -> CacheTrack | None:
        return self._tracks.by_id(id(cache))

    def _name(self, cache) -> str:
        self._count += 1
        return f"{type(cache).__name__}#{self._count}"

    def _add(self, cache, track: CacheTrack) -> CacheTrack:
        for dead in self._tracks.prune():
            self.discarded.append((dead.name, dead.model, tuple(dead.ids()[:IDS_KEPT])))
        self._tracks.add(cache, track, on_dead=track.release)  # its views must not outlive the cache
        return track

    def first_seen(
        self, cache, model: int | None, length: int, batch: int, made: str, capacity: int | None
    ) -> CacheTrack:
        """A cache kvtui meets in a forward: empty (made by the program or the forward), or holding
        `length` tokens it never saw."""
        rows = [[unknown_token(i) for i in range(length)] for _ in range(batch)]
        return self._add(
            cache,
            CacheTrack(
                self._name(cache), model, rows, made="unknown" if length else made, unknown=length, capacity=capacity
            ),
        )

    def release(self) -> None:
        """kvtui detaches: hold nothing of any cache's storage."""
        for track in self._tracks.values():
            track.release()

    def copied(self, parent: CacheTrack, copy, how: str, length: int) -> CacheTrack:
        """A copy of a watched cache: its parent's tokens, its own name and alarms."""
        rows = [list(row) for row in parent.rows]
        track = CacheTrack(
            self._name(copy),
            parent.model,
            rows,
            made=how,
            parent=parent.name,
            copied_at=length,
            unknown=parent.unknown,
            capacity=parent.capacity,
            turn=parent.turn,
            held=deepcopy(parent.held),
            masked=deepcopy(parent.masked),
        )
        return self._add(copy, track)

    def others(self, track: CacheTrack, model: int | None) -> list[tuple[str, list[int] | tuple[int, ...], bool]]:
        """(name, ids, alive) of the same model's other caches, live and discarded."""
        found: list[tuple[str, list[int] | tuple[int, ...], bool]] = [
            (t.name, t.ids(), True) for t in self._tracks.values() if t is not track and t.model == model
        ]
        found += [(name, ids, False) for name, owner, ids in self.discarded if owner == model]
        return found

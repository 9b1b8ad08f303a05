"""The regions of a step's attention: a partition of the buffer's positions, so their shares add to 100 %.

Each position is counted once, in the first of these that takes it (the precedence):

1. `pad`: masked pads, a primed prefix, the pad id where it is distinct from the end ids, runs of the pad id;
2. `sink`: position 0;
3. `special`: the other special tokens (template markers, end tokens);
4. `last W`: the newest W positions that none of the above took (the recent window);
5. what the token is: `system` (the system prompt: tokens of origin system, and template tokens before the first
   user token), `unknown` (held before kvtui watched), or its turn (`turn N`; the step's own is `this turn`).

A position's class (everything but the window) depends on its token only, once a pad run is seen: the index keeps
one class id per scanned position (on the host, and a copy on the device that grows with the buffer), so a step's
shares are ONE `index_add` over the positions known when it is staged; the positions still to come and the window
are added on the host from the columns read back with them (`shares`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from functools import reduce
from itertools import compress, groupby, repeat
from operator import add, itemgetter, ne, sub

import torch

from ..records.snapshot import BufferToken

PAD, SINK, SPECIAL, SYSTEM, UNKNOWN, TURNS = range(6)  # class ids; turn t is TURNS + t
CONTENT = SYSTEM  # classes from here on give way to the recent window
NAMES = {PAD: "pad", SINK: "sink", SPECIAL: "special", SYSTEM: "system", UNKNOWN: "unknown"}
ORDER = (SINK, PAD, SPECIAL)  # the rows' order: these, the window, then system, unknown and the turns


def region_names(classes: Sequence[int], turn: int) -> list[str]:
    """The row name of each class id."""
    return [NAMES[c] if c < TURNS else "this turn" if c - TURNS == turn else f"turn {c - TURNS}" for c in classes]


class RegionIndex:
    """The class of every position of the (append-only) buffer, kept up to date as it grows."""

    def __init__(self):
        self._reset(None, None)

    def _reset(self, items: object, pad_id: int | None) -> None:
        self._items: object = items
        self._scanned = 0
        self._pad_id: int | None = pad_id
        self._user_seen = False  # template tokens before the first user token are the system prompt
        self.classes: list[int] = []  # per scanned position
        self.counts: dict[int, int] = {}  # class -> positions
        self._pads: list[int] = []
        self._device: torch.Tensor | None = None  # the classes on the device (capacity >= synced)
        self._synced = 0  # positions of `classes` written to `_device`
        self._dirty: list[int] = []  # synced positions whose class changed since (a pad run found later)

    @property
    def items(self) -> object:
        return self._items

    @property
    def pad_id(self) -> int | None:
        return self._pad_id

    @property
    def scanned(self) -> int:
        return self._scanned

    def pads(self) -> list[int]:
        return self._pads

    def class_count(self) -> int:
        return max(self.counts, default=0) + 1

    def scan(self, buffer: Sequence[BufferToken], pad_id: int | None, pad_distinct: bool) -> None:
        """Classify the positions not scanned yet (starts over for another buffer, a shorter one, another pad)."""
        items = getattr(buffer, "_items", None)
        if items is None or items is not self._items or len(buffer) < self._scanned or pad_id != self._pad_id:
            self._reset(items, pad_id)
        for position in range(self._scanned, len(buffer)):
            token = buffer[position]
            pad = token.origin in ("pad", "primed") or (token.id == pad_id and pad_distinct)
            if not pad and pad_id is not None and token.id == pad_id and position and buffer[position - 1].id == pad_id:
                pad = True  # a run of the pad id (a pad that doubles as EOS): the one before it is a pad too
                if not self._pads or self._pads[-1] != position - 1:
                    self._pads.append(position - 1)
                    self._reclass(position - 1, PAD)
            if token.origin == "user":
                self._user_seen = True
            if pad:
                self._pads.append(position)
                kind = PAD
            elif position == 0:
                kind = SINK
            elif token.special:
                kind = SPECIAL
            elif token.origin == "system" or (token.origin == "template" and not self._user_seen):
                kind = SYSTEM
            elif token.origin == "unknown":
                kind = UNKNOWN
            else:
                kind = TURNS + max(token.turn, 0)
            self.classes.append(kind)
            self.counts[kind] = self.counts.get(kind, 0) + 1
        self._scanned = len(buffer)

    def _reclass(self, position: int, kind: int) -> None:
        old = self.classes[position]
        self.counts[old] -= 1
        if not self.counts[old]:
            del self.counts[old]
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.classes[position] = kind
        if position < self._synced:
            self._dirty.append(position)

    def device_classes(self, count: int, device) -> torch.Tensor:
        """The first `count` classes as a long tensor on `device`: only what changed since the last call moves."""
        stored = self._device
        if stored is None or stored.device != torch.device(device) or stored.shape[0] < count or count < self._synced:
            stored = self._device = torch.zeros(max(256, 2 * count), dtype=torch.long, device=device)
            self._synced, self._dirty = 0, []
        if count > self._synced:
            stored[self._synced : count] = torch.tensor(self.classes[self._synced : count], dtype=torch.long)
            self._synced = count
        for position in self._dirty:
            stored[position] = self.classes[position]
        self._dirty = []
        return stored[:count]


def shares(
    index: RegionIndex,
    sums: list[list[float]],
    staged_classes: list[int],
    tail: list[list[float]],
    tail_from: int,
    known: int,
    total: int,
    window: int,
    turn: int,
) -> tuple[tuple[str, ...], list[tuple[float, ...]]]:
    """(names, per layer the share of each row) from the class sums over the first `known` positions (`sums`
    [layers][classes], as classed at stage: `staged_classes` from `tail_from`) and the columns read as they are
    from `tail_from` to `total` (`tail` [layers][total - tail_from]): the new positions added to their classes,
    the positions whose class changed since moved, the window's content positions moved to `last W`."""
    classes = index.classes  # scanned up to `total` at least
    first = max(total - window, 0)
    # the window's content positions, and the positions classed otherwise since stage: found by C-level passes (no
    # Python line per position; the weights below are still added one by one, in order, as floats are)
    windowed = list(compress(range(first, total), map(CONTENT.__le__, classes[first:total])))
    moved = list(compress(range(tail_from, known), map(ne, staged_classes, classes[tail_from:known])))
    present = dict(index.counts)
    for c, count in Counter(map(classes.__getitem__, windowed)).items():
        present[c] -= count
    rows = [c for c in ORDER if present.get(c)]
    rows += [c for c in sorted(present) if c >= CONTENT and present[c]]
    names = region_names(rows, turn)
    window_at = len([c for c in rows if c < CONTENT])  # `last W` comes after the rows that do not give way to it
    if windowed:
        names.insert(window_at, f"last {min(window, total)}")
    size = max(index.class_count(), len(sums[0]) if sums else 0) + 1
    # the window's columns, in order, and per class its own (the same in every layer): each layer subtracts them
    # from their class and adds them to `last W` by C-level folds, one weight after the other as a loop would
    window_columns = list(map(sub, windowed, repeat(tail_from)))
    window_by_class = [
        (c, list(map(itemgetter(1), run)))
        for c, run in groupby(sorted(zip(map(classes.__getitem__, windowed), window_columns)), key=itemgetter(0))
    ]  # sorted by class, then position: each class's columns keep their order
    out: list[tuple[float, ...]] = []
    for layer, columns in enumerate(tail):
        acc = list(sums[layer]) if sums else []
        acc += [0.0] * (size - len(acc))
        for p in moved:  # classed at stage; a pad run may have taken one since
            old, new = staged_classes[p - tail_from], classes[p]
            acc[old] -= columns[p - tail_from]
            acc[new] += columns[p - tail_from]
        for p in range(known, total):
            acc[classes[p]] += columns[p - tail_from]
        for c, taken in window_by_class:
            acc[c] = reduce(sub, map(columns.__getitem__, taken), acc[c])
        values = list(map(acc.__getitem__, rows))
        if windowed:
            values.insert(window_at, reduce(add, map(columns.__getitem__, window_columns), 0.0))
        out.append(tuple(values))
    return tuple(names), out

"""Fingerprints: has the cache changed between two forwards? (kvtui watch: a program that crops, resets,
replaces or edits its cache outside a forward.)"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain, compress, repeat
from operator import attrgetter, getitem, is_, itemgetter, methodcaller
from typing import Any

import torch

from ...records.snapshot import LayerInfo, fast_init
from .infos import layer_infos, plain_kv, uniform_infos
from .layers import CountReader, kind_of, layer_counts
from .transfer import HostReads

_KEYS, _VALUES, _VERSION = attrgetter("keys"), attrgetter("values"), attrgetter("_version")
_IS_INFERENCE, _SLOTS = methodcaller("is_inference"), methodcaller("size", -2)
_SHAPE, _STRIDE, _AS_STRIDED = attrgetter("shape"), methodcaller("stride"), torch.Tensor.as_strided
_LAYER, _VIEW = itemgetter(0), itemgetter(1)  # of a (layer index, view) entry
_HANDLE, _INDICES = itemgetter(0), itemgetter(1)  # of a PendingEdit's (reads handle, view positions) group


@fast_init  # made after every forward: its fields filled in one call, not one line each
@dataclass
class Fingerprint:
    """What a cache held after a forward, to tell at the next one whether the program touched it between.

    Per layer it keeps the layer object, its K and V tensors (references: the check is an identity test,
    no id or address reuse), its token counter when it has one, and autograd's in-place write counters.
    Inference tensors keep no write counter: for those `views` are their first and last filled slots
    (views, no copy) and `values` a copy of them, compared at the check. It keeps alive the tensors the
    cache held after the forward: the cache's own (no extra memory), unless the program replaces them
    before the next forward (then the old ones until that forward). `release()` lets go: at the check,
    when the cache dies, at detach; nothing is held while a forward runs."""

    layers: list  # [(layer, keys, values, counter or None, (K, V) write counters or None)]
    views: list = field(default_factory=list)  # [(layer index, K or V end-slots view)]
    values: list = field(default_factory=list)  # per group of equal-shaped views: (indices, stacked copy)
    # plain full-attention caches (most): the layers, then every K, then every V as one list, and their write
    # counters ((K counters, V counters); None: inference tensors), compared with C-level passes at the check
    plain: tuple | None = None

    def release(self) -> None:
        self.layers, self.views, self.values, self.plain = [], [], [], None

    def rows(self) -> tuple:
        """(kind, seen, K shape, K/V addresses[, write counters]) per layer, as they were."""
        out: list[tuple] = []
        for layer, keys, values, counter, versions in self.layers:
            kind = kind_of(layer)
            if not _kv_tensors(keys, values):
                out.append((kind, -1))
                continue
            seen = keys.shape[-2] if counter is None else counter
            out.append((kind, seen, keys.shape, keys.data_ptr(), values.data_ptr()) + (versions or ()))
        return tuple(out)


def _kv_tensors(keys, values) -> bool:
    return isinstance(keys, torch.Tensor) and keys.dim() == 4 and isinstance(values, torch.Tensor)


def _counter(layer, kind: str, keys, reader: CountReader) -> tuple[int | None, int]:
    """(its token counter, None for a full layer whose slots are its tokens; filled slots)."""
    if kind == "full":
        return None, keys.shape[-2]
    return layer_counts(layer, kind, reader)


def fingerprint(cache) -> Fingerprint:
    """The cache now, in O(layers) attribute reads (plus two end-slot views per inference layer):
    no K/V copy, no transfer to the host."""
    plain = _plain_fingerprint(list(getattr(cache, "layers", ())))
    if plain is not None:
        return plain
    layers: list[tuple] = []
    views = []
    reader = CountReader(cache)
    for index, layer in enumerate(getattr(cache, "layers", ())):
        keys: Any = getattr(layer, "keys", None)
        values: Any = getattr(layer, "values", None)
        if not _kv_tensors(keys, values):
            layers.append((layer, keys, values, None, None))
            continue
        counter, filled = _counter(layer, kind_of(layer), keys, reader)
        if keys.is_inference() or values.is_inference():
            versions = None
            if filled > 0:  # slots 0 and filled-1 (views, no copy)
                ends = slice(0, filled, max(1, filled - 1))
                views += [(index, keys[:, :, ends]), (index, values[:, :, ends])]
        else:  # autograd's counter of in-place writes: free to read
            versions = (keys._version, values._version)
        layers.append((layer, keys, values, counter, versions))
    return Fingerprint(layers, views, _stack(views))


def infos_and_fingerprint(cache, window: int | None = None) -> tuple[tuple[LayerInfo, ...], Fingerprint]:
    """A cache after a forward: its layers' infos (none for a cache without layers) and its fingerprint for the
    next forward's edit check, its layers' K and V listed once for both when they are plain (most caches)."""
    if not hasattr(cache, "layers"):
        return (), fingerprint(cache)
    layers = list(cache.layers)
    kv = plain_kv(layers) if layers and not getattr(cache, "offloading", False) else None
    infos = uniform_infos(layers, kv) if kv is not None else None
    plain = _plain_fingerprint(layers, kv) if kv is not None else None
    return (layer_infos(cache, window) if infos is None else infos), (fingerprint(cache) if plain is None else plain)


def _plain_fingerprint(layers: list, kv: tuple[list, list] | None = None) -> Fingerprint | None:
    """A cache of plain full-attention layers with one slot count (a dynamic cache): the same Fingerprint, built
    by C-level passes (attrgetter, map, zip), with one stacked copy of every layer's end slots when its tensors
    keep no write counter. `kv`: their `plain_kv`, when the caller read it already."""
    kv = kv if kv is not None else plain_kv(layers) if layers else None
    if kv is None:
        return None
    keys, values = kv
    slots = set(map(_SLOTS, keys))
    if len(slots) != 1:
        return None
    filled = slots.pop()
    views: list
    if any(map(_IS_INFERENCE, keys)) or any(map(_IS_INFERENCE, values)):
        versions = None  # slots 0 and filled-1 of every K, then of every V (views, no copy); none of an empty cache
        views = list(zip(chain(range(len(keys)), range(len(keys))), _end_slots(keys, values, filled))) if filled else []
    else:  # autograd's counters of in-place writes: free to read
        versions, views = (list(map(_VERSION, keys)), list(map(_VERSION, values))), []
    entries = list(zip(layers, keys, values, repeat(None), zip(*versions) if versions else repeat(None)))
    return Fingerprint(entries, views, _stack(views), ([*layers, *keys, *values], versions))


def _end_slots(keys: list, values: list, filled: int):
    """Views of slots 0 and filled-1 of every K, then every V ([batch, heads, 2 or 1, head_dim] each, no copy): when
    all share one shape and one stride (the usual case) each is one `as_strided` call, a third of the host time of
    an indexing view (the index's parsing, a slice per dimension); else each is indexed."""
    tensors = list(chain(keys, values))
    shapes, strides = set(map(_SHAPE, tensors)), set(map(_STRIDE, tensors))
    if len(shapes) == 1 and len(strides) == 1:
        (batch, heads, _, width), (s0, s1, s2, s3) = shapes.pop(), strides.pop()
        # the index below: slice(0, filled, max(1, filled - 1)) takes 1 slot (filled 1) or 2
        size, stride = (batch, heads, 1 if filled == 1 else 2, width), (s0, s1, s2 * max(1, filled - 1), s3)
        return map(_AS_STRIDED, tensors, repeat(size), repeat(stride))
    ends = (slice(None), slice(None), slice(0, filled, max(1, filled - 1)))
    return map(getitem, tensors, repeat(ends))


def _plain_same(plain: tuple, layers: list) -> bool:
    """Whether a plain fingerprint's layers still hold the same K/V tensors, unwritten (C-level passes)."""
    held, versions = plain
    try:
        now = [*layers, *map(_KEYS, layers), *map(_VALUES, layers)]
    except AttributeError:  # a layer lost its tensors: the per-layer comparison says how
        return False
    if len(now) != len(held) or not all(map(is_, now, held)):
        return False
    if versions is None:  # inference tensors: their values are compared in the step's transfer
        return True
    count = len(layers)
    return (list(map(_VERSION, now[count : 2 * count])), list(map(_VERSION, now[2 * count :]))) == versions


def _stack(views: list) -> list:
    """One stacked copy of the views: all in one when they are alike (the usual case: one call), else
    grouped by shape, dtype and device."""
    if not views:
        return []
    try:
        return [(range(len(views)), torch.stack(list(map(_VIEW, views))))]
    except RuntimeError:  # layers of different shapes (MLA K vs V, sliding windows) or devices
        groups: dict[tuple, list[int]] = {}
        for i, (_, view) in enumerate(views):
            groups.setdefault((view.shape, view.dtype, view.device), []).append(i)
        return [(indices, torch.stack([views[i][1] for i in indices])) for indices in groups.values()]


def _same(entry, layer, reader: CountReader) -> bool:
    held, keys, values, counter, versions = entry
    if layer is not held or getattr(layer, "keys", None) is not keys or getattr(layer, "values", None) is not values:
        return False
    if not _kv_tensors(keys, values):
        return True
    if counter is not None and _counter(layer, kind_of(layer), keys, reader)[0] != counter:
        return False
    return versions is None or versions == (keys._version, values._version)  # type: ignore[union-attr]  # _kv_tensors


def changed(before: Fingerprint, cache) -> str | None:
    """What the program did to the cache since `before` was taken, in words; None if nothing. Releases
    `before` (it is spent)."""
    reads = HostReads()
    change, pending = check_edits(before, cache, reads)
    return change if pending is None else pending.describe(reads)


@fast_init  # made before every forward of an inference cache
@dataclass
class PendingEdit:
    """The in-place edit check of a fingerprint whose shapes and tensors were unchanged, waiting for its values:
    per group of end-slot views, how many values differ ([views] int64 on the device, in a HostReads)."""

    groups: list  # [(reads handle, view positions)]
    view_layers: list[int]  # the layer of each view
    layers: int

    def describe(self, reads: HostReads) -> str | None:
        """The change in words once `reads` is resolved; None if nothing was edited."""
        flags = chain.from_iterable(map(reads.flat, map(_HANDLE, self.groups)))  # per view, in the groups' order
        edited = set(
            compress(map(self.view_layers.__getitem__, chain.from_iterable(map(_INDICES, self.groups))), flags)
        )
        if edited:
            return f"K/V values edited in place in {_layer_list(sorted(edited), self.layers)}"
        return None


def check_edits(before: Fingerprint, cache, reads: HostReads) -> tuple[str | None, PendingEdit | None]:
    """`changed`, its reads left to the caller's transfer: (the change in words when the layers' shapes or
    tensors tell it on the host, None; else the value check waiting in `reads`, None when nothing is left to
    read). Releases `before`."""
    try:
        layers = list(getattr(cache, "layers", ()))
        if before.plain is None or not _plain_same(before.plain, layers):
            reader = CountReader(cache)  # layer by layer (the plain comparison above reads no counter)
            if len(layers) != len(before.layers) or not all(
                _same(e, layer, reader) for e, layer in zip(before.layers, layers)
            ):
                change = describe_change(before.rows(), _rows(cache))  # None: replaced by equal ones (a no-op)
                if change is not None:
                    return change, None
        if not before.values:
            return None, None
        groups = []
        for indices, copy in before.values:
            now = torch.stack(list(map(_VIEW, map(before.views.__getitem__, indices))))  # the same slots, again
            differs = (now != copy).reshape(len(indices), -1).sum(dim=1)  # [views] values that differ
            groups.append((reads.add(differs), indices))
        return None, PendingEdit(groups, list(map(_LAYER, before.views)), len(layers))
    finally:
        before.release()


def _rows(cache) -> tuple:
    """The rows of a Fingerprint taken now (only to describe a change)."""
    return fingerprint(cache).rows()


def describe_change(before: tuple, after: tuple) -> str | None:
    """What changed between two fingerprints' rows, in words; None if nothing did."""
    if before == after:
        return None
    if len(before) != len(after):
        return f"its layer count changed from {len(before)} to {len(after)}"
    old = max((row[1] for row in before), default=0)
    new = max((row[1] for row in after), default=0)
    if new == 0 < old:
        return f"emptied: {old} -> 0 tokens (reset)"
    if new < old:
        return f"shortened from {old} to {new} tokens (cropped)"
    if new > old:
        return f"grew from {old} to {new} tokens (written outside a forward)"
    replaced = [i for i, (a, b) in enumerate(zip(before, after)) if a[3:5] != b[3:5]]
    if replaced:
        return f"K/V tensors replaced in {_layer_list(replaced, len(after))}"
    edited = [i for i, (a, b) in enumerate(zip(before, after)) if a[5:] != b[5:]]
    if edited:
        return f"K/V values edited in place in {_layer_list(edited, len(after))}"
    return "its layer shapes changed"


def _layer_list(indices: list[int], total: int) -> str:
    if len(indices) == total:
        return f"all {total} layers"
    shown = ", ".join(map(str, indices[:6])) + (", ..." if len(indices) > 6 else "")
    return f"{len(indices)} of {total} layers ({shown})"

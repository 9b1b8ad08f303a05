"""One device-to-host transfer per step: every small tensor a step reads (fed ids, mask columns, positions, the
top-k, the edit check's differences) is registered while the step runs and comes back together.

Each `tolist()` / `int()` of a tensor on a GPU waits for the device: five of them a step are five waits, and the
host does nothing while it waits. Registered tensors are reinterpreted as int64 words (ids and positions as
they are, float32 pairs by a view, other dtypes converted), concatenated on their device and read with one
`tolist()`; the host splits the words back. Shapes come from the tensors' metadata, never from a read.

Hook point: a module that reads something per step on the device (attention weights, ...) calls
`reads.add(tensor)` before the step resolves and `reads.rows(handle)` / `reads.flat(handle)` after: its
values arrive in the same transfer.
"""

from __future__ import annotations

import struct
from itertools import accumulate, chain
from operator import attrgetter, itemgetter, methodcaller
from typing import Literal

import torch

_INT = "int"  # int64 words as they are
_PAIRS = "f32"  # float32 pairs viewed as int64 words
_DOUBLE = "f64"  # float64 (any other float dtype converted) viewed as int64 words
_INT64 = torch.int64
_FLOAT32 = torch.float32


class HostReads:
    """Tensors to bring to the host at once (`add`), then their values (`resolve`, `flat`, `rows`)."""

    _host: list[int] | None = None  # every word, in the order added, once resolved

    def __init__(self):
        # (encoding, shape, its int64 words [m] on its tensor's device) per handle; once resolved, (encoding,
        # shape, first word, end) per handle
        self._parts: list[tuple] = []

    def __len__(self) -> int:
        return len(self._parts)

    def add(self, tensor: torch.Tensor) -> int:
        """Register `tensor` (any shape; ints, bools or floats); returns its handle. Nothing is read yet (its words'
        offsets and devices are worked out at `resolve`, for every tensor at once). Once resolved, `add` raises
        (a ResolvedReads: no check on the way here)."""
        if tensor.dtype is _INT64:  # ids, positions, counts (never requiring grad): as they are, flattened when not 1-D
            self._parts.append((_INT, tensor.shape, tensor if tensor.dim() == 1 else tensor.reshape(-1)))  # a view
        else:
            self._parts.append(_words(tensor))
        return len(self._parts) - 1

    def resolve(self) -> None:
        """The one transfer (one per device when tensors live on several): reads every added tensor."""
        parts = self._parts
        words = list(map(_WORDS, parts))  # let go of the device tensors below: only their places are kept
        ends = list(accumulate(map(_NUMEL, words)))
        self._parts = list(zip(map(_KIND, parts), map(_SHAPE, parts), chain((0,), ends), ends))
        devices = set(map(_DEVICE, words))
        if len(devices) == 1:
            self._host = (words[0] if len(words) == 1 else torch.cat(words)).tolist()  # [every word]
        elif not words:
            self._host = []
        else:
            host: list[int] = [0] * ends[-1]
            by_device: dict[torch.device, list[int]] = {}
            for handle, part in enumerate(words):
                by_device.setdefault(part.device, []).append(handle)
            for handles in by_device.values():
                values = torch.cat([words[h] for h in handles]).tolist()
                at = 0
                for h in handles:
                    first, end = self._parts[h][2], self._parts[h][3]
                    host[first:end] = values[at : at + end - first]
                    at += end - first
            self._host = host
        self.__class__ = ResolvedReads  # its reads answer without a check of whether this ran; adds are refused

    def flat(self, handle: int) -> list:
        """The tensor's values, flattened (ints for integer and bool tensors, floats otherwise). Resolves the
        reads when they were not (after that, ResolvedReads's own `flat` answers directly)."""
        self.resolve()
        return self.flat(handle)

    def rows(self, handle: int) -> list[list]:
        """A tensor's values as rows of its last dimension ([rows][last]; a 0-d or 1-d tensor is one row). Resolves
        the reads when they were not (after that, ResolvedReads's own `rows` answers directly)."""
        self.resolve()
        return self.rows(handle)


class ResolvedReads(HostReads):
    """A HostReads once its transfer is done (`resolve` makes it one): the values are on the host."""

    def add(self, tensor: torch.Tensor) -> int:
        raise RuntimeError("these reads were resolved already: a tensor added now would never be read")

    def resolve(self) -> None:
        return

    def flat(self, handle: int) -> list:
        kind, _, first, end = self._parts[handle]
        return self._host[first:end] if kind == _INT else _decode(kind, self._host[first:end])  # type: ignore[index]

    def rows(self, handle: int) -> list[list]:
        kind, shape, first, end = self._parts[handle]  # as `flat`, without a call of it per read
        values = self._host[first:end] if kind == _INT else _decode(kind, self._host[first:end])  # type: ignore[index]
        width = shape[-1] if shape else 1
        if width and width == len(values):  # one row (most reads)
            return [values]
        if width == 0:
            return [[] for _ in range(_rows_of(shape))]
        return [values[i : i + width] for i in range(0, len(values), width)]


_KIND, _SHAPE, _WORDS = itemgetter(0), itemgetter(1), itemgetter(2)  # of a part
_NUMEL, _DEVICE = methodcaller("numel"), attrgetter("device")


def _words(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], torch.Tensor]:
    """A tensor that is not int64 as (encoding, shape, int64 words [m])."""
    flat = tensor.detach().reshape(-1)  # a view when contiguous
    if tensor.dtype is _FLOAT32:  # the top-k's values (the common float case first): as pairs when aligned
        if flat.numel() % 2 == 0 and flat.storage_offset() % 2 == 0 and flat.is_contiguous():
            return _PAIRS, tensor.shape, flat.view(torch.int64)  # [numel / 2]: a view, no kernel
    elif not flat.is_floating_point() and not flat.is_complex():
        return _INT, tensor.shape, flat.to(torch.int64)
    return _DOUBLE, tensor.shape, flat.to(torch.float64).view(torch.int64)


def _rows_of(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape[:-1]:
        count *= size
    return count


def _decode(kind: str, words: list[int]) -> list:
    """Float words back to floats: their bytes (native order, as the device wrote them) read as float32 pairs or
    float64 (`kind`: not _INT)."""
    return memoryview(struct.pack(f"={len(words)}q", *words)).cast(_FORMAT[kind]).tolist()


_FORMAT: dict[str, Literal["f", "d"]] = {_PAIRS: "f", _DOUBLE: "d"}  # a float encoding's struct format

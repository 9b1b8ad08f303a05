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

import torch

_INT = "int"  # int64 words as they are
_PAIRS = "f32"  # float32 pairs viewed as int64 words
_DOUBLE = "f64"  # float64 (any other float dtype converted) viewed as int64 words
_INT64 = torch.int64


class HostReads:
    """Tensors to bring to the host at once (`add`), then their values (`resolve`, `flat`, `rows`)."""

    def __init__(self):
        self._words: list[torch.Tensor] = []  # [m] int64 each, on its tensor's device
        self._meta: list[tuple[str, tuple[int, ...], int, int]] = []  # (encoding, shape, first word, end)
        self._count = 0  # words added so far
        self._device: torch.device | None = None  # the device of every tensor added (None: none yet)
        self._mixed = False  # tensors on several devices: one transfer per device
        self._host: list[int] | None = None  # every word, in the order added, once resolved

    def __len__(self) -> int:
        return len(self._meta)

    def add(self, tensor: torch.Tensor) -> int:
        """Register `tensor` (any shape; ints, bools or floats); returns its handle. Nothing is read yet."""
        if self._host is not None:
            raise RuntimeError("these reads were resolved already: a tensor added now would never be read")
        dtype = tensor.dtype
        if dtype is _INT64:  # ids, positions, counts (never requiring grad): as they are, flattened when not 1-D
            kind, words = _INT, tensor if tensor.dim() == 1 else tensor.reshape(-1)  # a view when contiguous
        else:
            flat = tensor.detach().reshape(-1)  # a view when contiguous
            if not flat.is_floating_point() and not flat.is_complex():
                kind, words = _INT, flat.to(torch.int64)
            elif (
                dtype == torch.float32
                and flat.numel() % 2 == 0
                and flat.is_contiguous()
                and flat.storage_offset() % 2 == 0
            ):
                kind, words = _PAIRS, flat.view(torch.int64)  # [numel / 2]: a view, no kernel
            else:
                kind, words = _DOUBLE, flat.to(torch.float64).view(torch.int64)
        if words.device != self._device:
            self._mixed, self._device = self._device is not None or self._mixed, words.device
        start, self._count = self._count, self._count + words.numel()
        self._words.append(words)
        self._meta.append((kind, tuple(tensor.shape), start, self._count))
        return len(self._meta) - 1

    def resolve(self) -> None:
        """The one transfer (one per device when tensors live on several): reads every added tensor."""
        if self._host is not None:
            return
        words, self._words = self._words, []  # let go of the device tensors
        if not words:
            self._host = []
        elif not self._mixed:
            self._host = (words[0] if len(words) == 1 else torch.cat(words)).tolist()  # [every word]
        else:
            host: list[int] = [0] * self._count
            by_device: dict[torch.device, list[int]] = {}
            for handle, part in enumerate(words):
                by_device.setdefault(part.device, []).append(handle)
            for handles in by_device.values():
                values = torch.cat([words[h] for h in handles]).tolist()
                at = 0
                for h in handles:
                    first, end = self._meta[h][2], self._meta[h][3]
                    host[first:end] = values[at : at + end - first]
                    at += end - first
            self._host = host

    def flat(self, handle: int) -> list:
        """The tensor's values, flattened (ints for integer and bool tensors, floats otherwise)."""
        if self._host is None:
            self.resolve()
        assert self._host is not None
        kind, _, first, end = self._meta[handle]
        return self._host[first:end] if kind == _INT else _decode(kind, self._host[first:end])

    def rows(self, handle: int) -> list[list]:
        """A tensor's values as rows of its last dimension ([rows][last]; a 0-d or 1-d tensor is one row)."""
        values = self.flat(handle)
        shape = self._meta[handle][1]
        width = shape[-1] if shape else 1
        if width == 0:
            return [[] for _ in range(_rows_of(shape))]
        if width == len(values):
            return [values]
        return [values[i : i + width] for i in range(0, len(values), width)]


def _rows_of(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape[:-1]:
        count *= size
    return count


def _decode(kind: str, words: list[int]) -> list:
    if kind == _INT or not words:
        return words
    packed = struct.pack(f"={len(words)}q", *words)
    if kind == _PAIRS:
        return list(struct.unpack(f"={2 * len(words)}f", packed))
    return list(struct.unpack(f"={len(words)}d", packed))

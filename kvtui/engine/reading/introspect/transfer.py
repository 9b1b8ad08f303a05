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


class HostReads:
    """Tensors to bring to the host at once (`add`), then their values (`resolve`, `flat`, `rows`)."""

    def __init__(self):
        self._words: list[torch.Tensor] = []  # [m] int64 each, on its tensor's device
        self._meta: list[tuple[str, tuple[int, ...], int]] = []  # (encoding, shape, numel)
        self._values: list[list] | None = None

    def __len__(self) -> int:
        return len(self._meta)

    def add(self, tensor: torch.Tensor) -> int:
        """Register `tensor` (any shape; ints, bools or floats); returns its handle. Nothing is read yet."""
        if self._values is not None:
            raise RuntimeError("these reads were resolved already: a tensor added now would never be read")
        tensor = tensor.detach()
        numel = tensor.numel()
        flat = tensor.reshape(-1)  # a view when contiguous
        if tensor.dtype == torch.int64:
            kind, words = _INT, flat
        elif not tensor.is_floating_point() and not tensor.is_complex():
            kind, words = _INT, flat.to(torch.int64)
        elif (
            tensor.dtype == torch.float32 and numel % 2 == 0 and flat.is_contiguous() and flat.storage_offset() % 2 == 0
        ):
            kind, words = _PAIRS, flat.view(torch.int64)  # [numel / 2]: a view, no kernel
        else:
            kind, words = _DOUBLE, flat.to(torch.float64).view(torch.int64)
        self._words.append(words)
        self._meta.append((kind, tuple(tensor.shape), numel))
        return len(self._meta) - 1

    def resolve(self) -> None:
        """The one transfer (one per device when tensors live on several): reads every added tensor."""
        if self._values is not None:
            return
        values: list[list] = [[] for _ in self._meta]
        by_device: dict[torch.device, list[int]] = {}
        for handle, words in enumerate(self._words):
            by_device.setdefault(words.device, []).append(handle)
        for handles in by_device.values():
            parts = [self._words[h] for h in handles]
            host = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()  # [sum of words]
            start = 0
            for h in handles:
                count = self._words[h].numel()
                values[h] = _decode(self._meta[h][0], host[start : start + count])
                start += count
        self._values = values
        self._words = []  # let go of the device tensors

    def flat(self, handle: int) -> list:
        """The tensor's values, flattened (ints for integer and bool tensors, floats otherwise)."""
        self.resolve()
        assert self._values is not None
        return self._values[handle]

    def rows(self, handle: int) -> list[list]:
        """A tensor's values as rows of its last dimension ([rows][last]; a 0-d or 1-d tensor is one row)."""
        values = self.flat(handle)
        shape = self._meta[handle][1]
        width = shape[-1] if shape else 1
        if width == 0:
            return [[] for _ in range(_rows_of(shape))]
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

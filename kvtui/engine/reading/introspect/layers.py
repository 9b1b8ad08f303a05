"""What one cache layer is and holds: its kind, its token counts (read through one `CountReader` per
cache) and its storage bytes. The other modules of introspect read layers through these."""

from __future__ import annotations

from typing import Any

import torch


def seq_length(cache) -> int:
    """Tokens the cache has seen (5.x StaticCache returns a 0-dim tensor: hence int())."""
    return int(cache.get_seq_length())


def is_linear(layer) -> bool:
    """A layer with conv / recurrent state (Mamba, linear attention, short conv), possibly next to K/V."""
    return hasattr(layer, "conv_states") and hasattr(layer, "recurrent_states")


def is_quantized(layer) -> bool:
    """A QuantizedCache layer, before its first update too (4.57 sets `_quantized_keys` only then: a class judged
    from an empty layer must not be taken for a plain one, plain_kv caches its verdict per class)."""
    return hasattr(layer, "_quantized_keys") or (hasattr(layer, "_quantize") and hasattr(layer, "_dequantize"))


def dequantized_kv(layer) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What a quantized layer gives attention, read without changing it: its quantized part dequantized (with
    a beam reorder it deferred, 5.x) and its full-precision residual after it, K and V [batch, heads, seq, dim];
    None for a layer that is not quantized or holds nothing yet (a verify's cost: O(cache), never per step)."""
    if not is_quantized(layer) or getattr(layer, "_quantized_keys", None) is None:
        return None
    keys, values = layer._dequantize(layer._quantized_keys), layer._dequantize(layer._quantized_values)
    reorder = getattr(layer, "_apply_pending_reorder", None)
    if reorder is not None:
        keys, values = reorder(keys, values)
    if has_kv(layer) and layer.keys.shape[-2]:  # the residual: tokens not yet quantized
        keys = torch.cat([keys, layer.keys.to(keys.dtype)], dim=-2)
        values = torch.cat([values, layer.values.to(values.dtype)], dim=-2)
    return keys, values


def has_kv(layer) -> bool:
    keys = getattr(layer, "keys", None)
    return isinstance(keys, torch.Tensor) and keys.dim() == 4 and bool(getattr(layer, "is_initialized", True))


def _attention_kind(layer) -> str:
    static = hasattr(layer, "max_cache_len")
    sliding = bool(getattr(layer, "is_sliding", False)) or "Sliding" in type(layer).__name__
    if static:
        return "static-sliding" if sliding else "static"
    return "sliding" if sliding else "full"


def layer_kind(layer) -> str:
    if is_quantized(layer):
        return "quantized"
    if type(layer).__name__ == "DummyLayer":
        return "none"  # holds nothing (shared-KV or attention-free layers)
    return _attention_kind(layer)


_KINDS: dict[type, str] = {}  # layer class -> its kind (a class attribute in every version kvtui reads)


def kind_of(layer) -> str:
    """`layer_kind`, remembered per layer class (read at every step)."""
    found = _KINDS.get(type(layer))
    if found is None:
        found = _KINDS[type(layer)] = layer_kind(layer)
    return found


def state_kind(cache, layer) -> str:
    tagged = getattr(cache, "_kvtui_state_kind", None)
    if tagged:
        return tagged
    recurrent = any(t is not None for t in layer.recurrent_states.values())
    return "linear" if recurrent else "conv"


def linear_states(layer) -> tuple[tuple[tuple[str, tuple[int, ...]], ...], int]:
    """((name, shape), ...) and their storage bytes: conv windows and recurrent (SSM / delta-rule) states."""
    named, total, several = [], 0, len(layer.conv_states) > 1
    for prefix, states in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states)):
        for index, tensor in states.items():
            if isinstance(tensor, torch.Tensor):
                named.append((f"{prefix}{index}" if several else prefix, tuple(tensor.shape)))
                total += storage_bytes(tensor)
    return tuple(named), total


def storage_bytes(tensor) -> int:
    # The storage, not the view: a cropped dynamic layer still holds its larger buffer until the next cat.
    if tensor is None:
        return 0
    try:
        return tensor.untyped_storage().nbytes()
    except (AttributeError, RuntimeError):
        return tensor.numel() * tensor.element_size()


def _on_host(counter: torch.Tensor) -> bool:
    return counter.is_cpu  # reading it waits for no device: int() on it is the cheapest read there is


class CountReader:
    """A cache's length and its static layers' token counters, each read when a layer first needs it (5.x
    counts in `cumulative_length_int`, or in a 0-dim tensor on the cache's device; 4.x has no counter).
    The counters on a device are read together, one host transfer per device: int() on each would wait
    for the device once per layer (on a GPU, ~60 waits a step for 30 layers). Those on the CPU are read one
    by one (stacking them costs more than it saves there)."""

    def __init__(self, cache, length: int | None = None):
        self._cache = cache
        self._length = length
        self._read: dict[int, int] | None = None  # id(layer) -> its count, for the layers being read now

    def length(self) -> int:
        if self._length is None:
            self._length = seq_length(self._cache)
        return self._length

    def counter(self, layer) -> int | None:
        """Tokens written into a static layer, or None if it keeps no counter (4.x)."""
        if hasattr(layer, "cumulative_length_int"):
            return int(layer.cumulative_length_int)
        counter = getattr(layer, "cumulative_length", None)
        if counter is None:
            return None
        if _device_counter(layer) is None:
            return int(counter)
        if self._read is None:
            self._read = _read_counters(self._cache.layers)
        found = self._read.get(id(layer))
        return int(counter) if found is None else found


def _device_counter(layer) -> torch.Tensor | None:
    """A layer's token counter when it is a 0-dim tensor off the CPU (read together with its kind)."""
    if hasattr(layer, "cumulative_length_int"):
        return None
    counter = getattr(layer, "cumulative_length", None)
    if isinstance(counter, torch.Tensor) and counter.dim() == 0 and not _on_host(counter):
        return counter
    return None


def _read_counters(layers) -> dict[int, int]:
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for layer in layers:
        counter = _device_counter(layer)
        if counter is not None:
            by_device.setdefault(counter.device, []).append((id(layer), counter))
    read: dict[int, int] = {}
    for entries in by_device.values():
        values = torch.stack([counter for _, counter in entries]).tolist()  # [layers]: one transfer
        read.update(zip((key for key, _ in entries), values))
    return read


def layer_counts(layer, kind: str, reader: CountReader) -> tuple[int, int]:
    """(seen, filled): tokens fed to this layer in total, and slots holding real states now."""
    keys: Any = getattr(layer, "keys", None)
    initialized = keys is not None and getattr(layer, "is_initialized", True) and keys.dim() == 4
    slots = keys.shape[-2] if initialized else 0
    if kind == "full":
        return slots, slots
    if kind == "sliding":
        seen = int(getattr(layer, "cumulative_length", slots))
        return seen, slots
    # static layers hold max_cache_len slots whatever is written: the counter is the truth.
    counter = reader.counter(layer) if initialized else 0
    seen = reader.length() if counter is None else counter
    return seen, min(seen, slots)

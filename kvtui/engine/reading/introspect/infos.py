"""One LayerInfo per cache layer, from shapes and counters only: the layers pane and every step's record.

On the hot path (every forward of a watched program, every layer): most layers take `_plain_info`, whose
names and kinds are remembered per class, dtype and device.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import MISSING, fields
from itertools import chain, repeat
from operator import add, attrgetter, itemgetter, methodcaller
from typing import Any

import torch

from ...records.snapshot import LayerInfo
from .layers import (
    CountReader,
    has_kv,
    is_linear,
    is_quantized,
    kind_of,
    layer_counts,
    layer_kind,
    linear_states,
    state_kind,
    storage_bytes,
)


def layer_infos(cache, config_window: int | None = None) -> tuple[LayerInfo, ...]:
    """One LayerInfo per cache layer, from shapes and counters only."""
    offloading = bool(getattr(cache, "offloading", False))
    if not offloading:
        uniform = uniform_infos(cache.layers)
        if uniform is not None:  # the cache's length is not asked: its layers' shapes tell it
            return uniform
    reader = CountReader(cache)
    cache_len = reader.length()
    only_non_sliding = bool(getattr(cache, "only_non_sliding", False))
    infos = []
    for index, layer in enumerate(cache.layers):
        kind = kind_of(layer)
        if kind == "full" and not offloading and type(layer) not in _NOT_PLAIN:
            info = _plain_info(index, layer)  # most layers of most caches: shapes and storage only
            if info is not None:
                infos.append(info)
                continue
        if kind == "quantized":
            infos.append(_quantized_info(index, layer, offloading))
            continue
        linear = is_linear(layer)
        states, state_bytes = linear_states(layer) if linear else ((), 0)
        offloaded = offloading and not linear and kind != "none" and not (only_non_sliding and "sliding" in kind)
        if (
            linear
            and not has_kv(layer)
            and not hasattr(layer, "max_cache_len")
            and not isinstance(getattr(layer, "keys", None), torch.Tensor)
        ):
            infos.append(_state_info(index, layer, state_kind(cache, layer), states, state_bytes, cache_len))
            continue
        if linear:
            kind = f"{kind}+{state_kind(cache, layer)}"
        keys: Any = getattr(layer, "keys", None)
        values: Any = getattr(layer, "values", None)
        has_states = keys is not None and keys.dim() == 4
        base = kind.split("+")[0]
        seen, filled = layer_counts(layer, base, reader)
        if base in ("full", "none"):
            capacity, window = None, None
        elif base == "sliding":
            window = int(getattr(layer, "sliding_window", config_window or 0)) or None
            capacity = window - 1 if window else None  # it keeps the last window-1 between steps
        else:
            capacity = int(layer.max_cache_len)
            window = capacity if base == "static-sliding" else None
        infos.append(
            LayerInfo(
                index=index,
                kind=kind,
                k_shape=tuple(keys.shape) if has_states else (),
                v_shape=tuple(values.shape) if has_states else (),
                dtype=str(keys.dtype).removeprefix("torch.") if has_states else "-",
                device=str(keys.device) if has_states else "-",
                bytes=(storage_bytes(keys) + storage_bytes(values) if has_states else 0) + state_bytes,
                filled=filled,
                capacity=capacity,
                window=window,
                seen=seen,
                held_from=seen - filled,
                states=states,
                state_bytes=state_bytes,
                offloaded=offloaded,
            )
        )
    return tuple(infos)


_KEYS, _VALUES, _SHAPE = attrgetter("keys"), attrgetter("values"), attrgetter("shape")
_DTYPE, _DEVICE = attrgetter("dtype"), attrgetter("device")
_DIM, _STORAGE, _NBYTES = methodcaller("dim"), methodcaller("untyped_storage"), methodcaller("nbytes")
_PLAIN: set[type] = set()  # layer classes that are full attention holding only K/V (checked once per class)


def plain_kv(layers) -> tuple[list, list] | None:
    """(keys, values) of every layer when all are initialised full-attention layers of plain classes holding 4-D
    K and V (most caches), else None. C-level passes over the layers (map, attrgetter): no Python runs per layer,
    so the host time of a step does not grow with the layer count (on a GPU it is what a watched step costs)."""
    classes = set(map(type, layers))
    if not classes <= _PLAIN:
        for cls, sample in dict(zip(map(type, layers), layers)).items():  # one per class, once
            if cls in _PLAIN or cls in _NOT_PLAIN:
                continue
            if kind_of(sample) != "full" or is_linear(sample) or is_quantized(sample):
                _NOT_PLAIN.add(cls)
            else:
                _PLAIN.add(cls)
        if not classes <= _PLAIN:
            return None
    if not all(map(getattr, layers, repeat("is_initialized"), repeat(True))):  # (4.x has no flag: its tensors tell)
        return None
    keys, values = list(map(_KEYS, layers)), list(map(_VALUES, layers))
    if {*map(type, keys), *map(type, values)} != {torch.Tensor} or {*map(_DIM, keys), *map(_DIM, values)} != {4}:
        return None
    return keys, values


def uniform_infos(layers, kv: tuple[list, list] | None = None) -> tuple[LayerInfo, ...] | None:
    """Every layer's LayerInfo when all are plain full-attention layers on one dtype and device (the same
    LayerInfos `_plain_info` gives one by one), built by C-level maps; None for any other cache. `kv`: their
    `plain_kv`, when the caller read it already."""
    layers = list(layers)
    kv = kv if kv is not None else plain_kv(layers) if layers else None
    if kv is None:
        return None
    keys, values = kv
    dtypes, devices = set(map(_DTYPE, keys)), set(map(_DEVICE, keys))
    if len(dtypes) != 1 or len(devices) != 1:
        return None
    try:  # storage bytes: the storage, not the view (as storage_bytes)
        sizes = list(map(add, map(_NBYTES, map(_STORAGE, keys)), map(_NBYTES, map(_STORAGE, values))))
    except (AttributeError, RuntimeError):
        return None
    k_shapes = list(map(tuple, map(_SHAPE, keys)))  # [batch, kv_heads, slots, head_dim] each
    slots = list(map(itemgetter(2), k_shapes))
    count = len(layers)
    return _bulk_layer_infos(
        count,
        **_uniform_columns(count, keys[0].dtype, keys[0].device),
        k_shape=k_shapes,
        v_shape=map(tuple, map(_SHAPE, values)),
        bytes=sizes,
        filled=slots,
        seen=slots,
    )


@functools.lru_cache(maxsize=64)  # (layer count, dtype, device) -> the columns every step repeats
def _uniform_columns(count: int, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """The columns of a uniform cache's LayerInfos that do not change from step to step (sequences, not iterators:
    made once, read by every step's C-level passes; shared: only passed on with `**`)."""
    return dict(
        index=range(count),
        kind=("full",) * count,
        dtype=(_text(dtype),) * count,
        device=(_text(device),) * count,
        held_from=(0,) * count,
    )


# LayerInfo's fields: their slots' setters (member descriptors) and defaults (none is a factory)
_FIELDS = fields(LayerInfo)
assert all(f.default_factory is MISSING for f in _FIELDS), "a LayerInfo field with a factory"
_NAMES = [f.name for f in _FIELDS]
_SETTERS = [LayerInfo.__dict__[f.name].__set__ for f in _FIELDS]
_DEFAULTS = [None if f.default is MISSING else f.default for f in _FIELDS]  # capacity and window: None
_REQUIRED = {f.name for f in _FIELDS if f.default is MISSING} - {"capacity", "window"}


def _bulk_layer_infos(count: int, **columns) -> tuple[LayerInfo, ...]:
    """`count` LayerInfos from columns (field -> iterable of `count` values; capacity, window and the additive
    fields default), equal to LayerInfo(...) each: every field set on every object by its slot's descriptor, as
    the class's own __init__ sets it, in C-level passes (map, chain), so building them runs no Python per layer."""
    assert _REQUIRED <= columns.keys(), _REQUIRED - columns.keys()
    made = list(map(object.__new__, repeat(LayerInfo, count)))
    given = map(columns.get, _NAMES, map(repeat, _DEFAULTS, repeat(count)))  # each field's column, or its default
    deque(chain.from_iterable(map(map, _SETTERS, repeat(made), given)), maxlen=0)  # setter(obj, value), all
    return tuple(made)


_NOT_PLAIN: set[type] = set()  # layer classes with more than K/V (linear states, ...): the general path
_TEXT: dict[object, str] = {}  # torch.dtype / torch.device -> its name in a LayerInfo


def _text(value) -> str:
    text = _TEXT.get(value)
    if text is None:
        text = _TEXT[value] = str(value).removeprefix("torch.")
    return text


def _plain_info(index: int, layer) -> LayerInfo | None:
    """A full-attention layer that holds only K and V (the general path gives the same LayerInfo)."""
    if is_linear(layer) or is_quantized(layer):
        _NOT_PLAIN.add(type(layer))
        return None
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if not (
        isinstance(keys, torch.Tensor)
        and keys.dim() == 4
        and isinstance(values, torch.Tensor)
        and getattr(layer, "is_initialized", True)
    ):
        return None
    slots = keys.shape[-2]
    return LayerInfo(
        index,
        "full",
        tuple(keys.shape),
        tuple(values.shape),
        _text(keys.dtype),
        _text(keys.device),
        storage_bytes(keys) + storage_bytes(values),
        slots,
        None,
        None,
        slots,
        0,
    )


def _state_info(index: int, layer, kind: str, states: tuple, state_bytes: int, cache_len: int) -> LayerInfo:
    """A layer of conv / recurrent state only: it summarizes every token it was fed, in a fixed-size state."""
    return LayerInfo(
        index=index,
        kind=kind,
        k_shape=(),
        v_shape=(),
        dtype=str(layer.dtype).removeprefix("torch.") if layer.dtype is not None else "-",
        device=str(layer.device) if layer.device is not None else "-",
        bytes=state_bytes,
        filled=cache_len if states else 0,
        capacity=None,
        window=None,
        seen=cache_len if states else 0,
        held_from=0,
        states=states,
        state_bytes=state_bytes,
    )


def _tensor_bytes(obj, seen: set) -> int:
    """Storage bytes of the tensors in a quantized state (plain tensors, tensor subclasses, tuples, dicts)."""
    if isinstance(obj, torch.Tensor):
        flatten = getattr(obj, "__tensor_flatten__", None)
        if flatten is not None and type(obj) is not torch.Tensor:  # quanto's QTensor: its inner tensors
            names, _ = flatten()
            return sum(_tensor_bytes(getattr(obj, name), seen) for name in names)
        try:
            storage = obj.untyped_storage()
            key = storage.data_ptr()
            if key in seen:
                return 0
            seen.add(key)
            return storage.nbytes()
        except (AttributeError, RuntimeError):
            return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(item, seen) for item in obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(item, seen) for item in obj.values())
    return 0


def _quantized_shape(q) -> tuple[int, ...]:
    """The logical [batch, heads, tokens, head_dim] of a quantized state (HQQ packs it: its meta keeps it)."""
    if isinstance(q, tuple) and len(q) == 2 and isinstance(q[1], dict) and "shape" in q[1]:
        return tuple(int(d) for d in q[1]["shape"])  # HQQ: (packed, meta)
    if isinstance(q, tuple):
        q = q[0]  # fp8: (tensor, scale)
    return tuple(q.shape) if isinstance(q, torch.Tensor) else ()


def _quantized_info(index: int, layer, offloaded: bool) -> LayerInfo:
    residual = layer.keys.shape[-2] if has_kv(layer) else 0
    quantized_keys = getattr(layer, "_quantized_keys", None)  # 4.57: set at the first update only
    quantized_values = getattr(layer, "_quantized_values", None)
    stored = _quantized_shape(quantized_keys) if quantized_keys is not None else ()
    stored_v = _quantized_shape(quantized_values) if quantized_values is not None else ()
    seen = int(getattr(layer, "cumulative_length", 0))
    seen_ids: set = set()
    quant_bytes = _tensor_bytes(quantized_keys, seen_ids) + _tensor_bytes(quantized_values, seen_ids)
    residual_bytes = (storage_bytes(layer.keys) + storage_bytes(layer.values)) if residual else 0
    dtype = getattr(layer, "dtype", None)
    # K/V shapes: what the layer answers for (quantized part + full-precision window), [b, heads, seen, dim]
    k_shape = stored[:2] + (seen,) + stored[3:] if len(stored) == 4 else ()
    v_shape = stored_v[:2] + (seen,) + stored_v[3:] if len(stored_v) == 4 else ()
    return LayerInfo(
        index=index,
        kind="quantized",
        k_shape=k_shape,
        v_shape=v_shape,
        dtype=str(dtype).removeprefix("torch.") if dtype is not None else "-",
        device=str(layer.device) if getattr(layer, "device", None) is not None else "-",
        bytes=quant_bytes + residual_bytes,
        filled=seen,
        capacity=None,
        window=None,
        seen=seen,
        held_from=0,
        quant_bits=int(getattr(layer, "nbits", 8)),
        quant_group=getattr(layer, "q_group_size", None),
        quant_bytes=quant_bytes,
        residual=residual,
        residual_capacity=getattr(layer, "residual_length", None),
        offloaded=offloaded,
    )


def static_capacity(cache) -> int | None:
    """Tokens a static cache can take before its full-attention layers overflow; None if it cannot."""
    full_static = [int(layer.max_cache_len) for layer in cache.layers if layer_kind(layer) == "static"]
    return min(full_static) if full_static else None

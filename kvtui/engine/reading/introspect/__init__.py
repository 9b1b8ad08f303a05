"""The one module that knows transformers' cache internals, and how they differ between versions.

Everything here reads `.shape`, `.dtype`, counters and class names: O(layers), no K/V copies.
`truncate` also writes those internals (static caches have no `crop`), but only `session.py` calls it:
the session stays the one place that decides when the cache changes.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch
import transformers
from transformers import DynamicCache, StaticCache

from ...records.snapshot import LayerInfo


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


TRANSFORMERS_VERSION = _version(transformers.__version__)


CACHE_KINDS = ("dynamic", "static", "quantized", "offloaded")
QUANT_BACKENDS = ("quanto", "hqq", "fp8")
# Group size and full-precision window of the quantized cache: small enough that a short chat quantizes.
QUANT_GROUP = 32
QUANT_RESIDUAL = 32


def make_cache(kind: str, config, max_cache_len: int | None = None, *, bits: int = 4, backend: str = "quanto"):
    """A fresh cache of the kind asked for, with per-layer types from the config (sliding or full)."""
    if kind == "dynamic":
        try:
            cache = DynamicCache(config=config)
        except TypeError:  # very old signature: full layers only
            cache = DynamicCache()
    elif kind == "offloaded":
        try:
            cache = DynamicCache(config=config, offloading=True)
        except TypeError as exc:
            raise ValueError(
                f"this transformers ({transformers.__version__}) has no offloaded DynamicCache: {exc}"
            ) from None
    elif kind == "static":
        if not max_cache_len or max_cache_len < 1:
            raise ValueError("a static cache needs --max-cache-len N (N >= 1)")
        cache = StaticCache(config=config, max_cache_len=max_cache_len)
    elif kind == "quantized":
        cache = _quantized_cache(config, bits, backend)
    else:
        raise ValueError(f"unknown cache kind {kind!r}: use {', '.join(CACHE_KINDS)}")
    _tag_state_kind(cache, config)
    return cache


def _quantized_cache(config, bits: int, backend: str):
    try:
        from transformers import QuantizedCache
    except ImportError:
        raise ValueError(f"this transformers ({transformers.__version__}) has no QuantizedCache") from None
    if backend not in QUANT_BACKENDS:
        raise ValueError(f"unknown quantization backend {backend!r}: use {', '.join(QUANT_BACKENDS)}")
    refusal = quant_backend_refusal(backend)
    if refusal:
        raise ValueError(refusal)
    if backend == "fp8":
        kwargs = {}
    else:
        kwargs = dict(nbits=bits, q_group_size=QUANT_GROUP, residual_length=QUANT_RESIDUAL)
    try:
        return QuantizedCache(backend=backend, config=config, **kwargs)
    except ImportError as exc:  # the backend package is missing
        raise ValueError(f"the {backend} quantized cache needs its package: {_first_line(exc)}") from None
    except (ValueError, TypeError) as exc:  # e.g. sliding or linear layers: "only ... full attention layers"
        raise ValueError(f"quantized cache refused by transformers: {_first_line(exc)}") from None


@lru_cache(maxsize=8)
def quant_backend_known(backend: str) -> bool:
    """Feature test: does this transformers' `QuantizedCache` know the backend? (4.57 knows quanto and hqq;
    fp8 came later.) Asked of QuantizedCache itself on a one-layer config: only its "unknown backend"
    refusal says no; a missing backend package (ImportError) or anything else means it knows the name."""
    try:
        from transformers import PretrainedConfig, QuantizedCache
    except ImportError:
        return False
    try:
        QuantizedCache(backend=backend, config=PretrainedConfig(num_hidden_layers=1))
    except ValueError as exc:
        return "nknown quantization backend" not in str(exc)
    except Exception:  # noqa: BLE001 - the package, the config: it got past the backend's name
        return True
    return True


def quant_backends() -> tuple[str, ...]:
    return tuple(b for b in QUANT_BACKENDS if quant_backend_known(b))


def quant_backend_refusal(backend: str) -> str | None:
    """One line where this transformers' QuantizedCache lacks the backend (checked before any screen)."""
    if backend not in QUANT_BACKENDS or quant_backend_known(backend):
        return None
    return (
        f"--cache-backend {backend}: this transformers ({transformers.__version__}) has no {backend} quantized "
        f"cache (its QuantizedCache knows {', '.join(quant_backends()) or 'no backend'})"
    )


# What a config declares when its model keeps conv / SSM / linear-attention state besides (or instead of) K/V.
_STATE_ATTRIBUTES = (
    "mamba_d_state",
    "ssm_state_size",
    "state_size",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "conv_L_cache",
)
_ATTENTION_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}


def _text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def declares_state(config) -> bool:
    text = _text_config(config)
    types = getattr(text, "layer_types", None)
    if types:  # the layers say it (an LFM2 of attention layers only keeps no conv state)
        return any(t not in _ATTENTION_TYPES for t in types)
    return any(hasattr(text, name) for name in _STATE_ATTRIBUTES)


def _dynamic_cache_keeps_state(config) -> bool:
    try:
        cache = DynamicCache(config=config)
    except Exception:  # noqa: BLE001 - a cache it cannot build keeps nothing
        return False
    return any(_is_linear(layer) for layer in getattr(cache, "layers", ()))


def hybrid_refusal(config) -> str | None:
    """One line where the model keeps conv/SSM state that this transformers' DynamicCache does not hold
    (4.57: hybrids keep it in their own cache class, which kvtui does not read), else None.
    A feature test: build `DynamicCache(config=...)` and look for layers with conv/recurrent states."""
    if not declares_state(config):
        return None
    if _dynamic_cache_keeps_state(config):
        return None
    name = getattr(config, "model_type", None) or type(config).__name__
    return (
        f"{name} keeps conv/SSM state that this transformers ({transformers.__version__}) does not put in "
        f"DynamicCache's layers (it uses the model's own cache class): kvtui cannot inspect this hybrid here "
        f"(transformers 5.23+ can)"
    )


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _tag_state_kind(cache, config) -> None:
    """Remember what a linear layer's state is (ssm, linear attention, conv): the cache object cannot tell."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if any(hasattr(text, name) for name in ("mamba_d_state", "ssm_state_size", "state_size")):
        kind = "ssm"  # Mamba / Mamba-2 blocks (Jamba, Falcon-H1, Bamba, ...)
    elif hasattr(text, "linear_conv_kernel_dim") or hasattr(text, "linear_key_head_dim"):
        kind = "linear"  # gated delta rule / linear attention (Qwen3-Next, Qwen3.5)
    else:
        kind = None  # decided from the states: conv-only layers are "conv"
    try:
        cache._kvtui_state_kind = kind
    except AttributeError:  # a cache class with __slots__: fall back to the states
        pass


def seq_length(cache) -> int:
    """Tokens the cache has seen (5.x StaticCache returns a 0-dim tensor: hence int())."""
    return int(cache.get_seq_length())


@lru_cache(maxsize=64)
def _forward_parameters(forward) -> frozenset[str]:
    return frozenset(inspect.signature(forward).parameters)


def forward_accepts(model, name: str) -> bool:
    """From 5.4 models take no `cache_position` and silently ignore one; 4.x needs it for static caches."""
    return name in _forward_parameters(type(model).forward)


# The names a forward's cache goes by: `cache` from 5.24, which still takes (and renames, with a deprecation
# warning) `past_key_values` and the SSM models' `cache_params`; `past_key_values` before. generate() passes
# the new name, a user's own loop either. Outputs likewise: `.cache` from 5.24, `.past_key_values` before.
CACHE_ARGUMENTS = ("cache", "past_key_values", "cache_params")


def cache_argument(model) -> str:
    """The keyword this model's forward takes its cache by: 'cache' (5.24+) or 'past_key_values'."""
    return "cache" if forward_accepts(model, "cache") else "past_key_values"


def _is_cache(value) -> bool:
    return hasattr(value, "get_seq_length")


def cache_in(arguments: dict):
    """The cache object among a forward's arguments (by any of its names), or None."""
    return next((arguments[name] for name in CACHE_ARGUMENTS if _is_cache(arguments.get(name))), None)


def output_cache(output):
    """The cache a forward returned, or None; read without tripping 5.24's deprecated-name warning."""
    if isinstance(output, dict):  # ModelOutput: an OrderedDict of the fields that are set (get() would warn)
        return next((value for name, value in output.items() if name in CACHE_ARGUMENTS and _is_cache(value)), None)
    return next((v for name in CACHE_ARGUMENTS if _is_cache(v := getattr(output, name, None))), None)


def _is_linear(layer) -> bool:
    """A layer with conv / recurrent state (Mamba, linear attention, short conv), possibly next to K/V."""
    return hasattr(layer, "conv_states") and hasattr(layer, "recurrent_states")


def _is_quantized(layer) -> bool:
    return hasattr(layer, "_quantized_keys")


def _has_kv(layer) -> bool:
    keys = getattr(layer, "keys", None)
    return isinstance(keys, torch.Tensor) and keys.dim() == 4 and bool(getattr(layer, "is_initialized", True))


def _attention_kind(layer) -> str:
    static = hasattr(layer, "max_cache_len")
    sliding = bool(getattr(layer, "is_sliding", False)) or "Sliding" in type(layer).__name__
    if static:
        return "static-sliding" if sliding else "static"
    return "sliding" if sliding else "full"


def _layer_kind(layer) -> str:
    if _is_quantized(layer):
        return "quantized"
    if type(layer).__name__ == "DummyLayer":
        return "none"  # holds nothing (shared-KV or attention-free layers)
    return _attention_kind(layer)


def _state_kind(cache, layer) -> str:
    kind = getattr(cache, "_kvtui_state_kind", None)
    if kind:
        return kind
    recurrent = any(t is not None for t in layer.recurrent_states.values())
    return "linear" if recurrent else "conv"


def _linear_states(layer) -> tuple[tuple[tuple[str, tuple[int, ...]], ...], int]:
    """((name, shape), ...) and their storage bytes: conv windows and recurrent (SSM / delta-rule) states."""
    named, total, several = [], 0, len(layer.conv_states) > 1
    for prefix, states in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states)):
        for index, tensor in states.items():
            if isinstance(tensor, torch.Tensor):
                named.append((f"{prefix}{index}" if several else prefix, tuple(tensor.shape)))
                total += _storage_bytes(tensor)
    return tuple(named), total


def _storage_bytes(tensor) -> int:
    # The storage, not the view: a cropped dynamic layer still holds its larger buffer until the next cat.
    if tensor is None:
        return 0
    try:
        return tensor.untyped_storage().nbytes()
    except (AttributeError, RuntimeError):
        return tensor.numel() * tensor.element_size()


def _on_host(counter: torch.Tensor) -> bool:
    return counter.is_cpu  # reading it waits for no device: int() on it is the cheapest read there is


class _CountReader:
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


def _layer_counts(layer, kind: str, reader: _CountReader) -> tuple[int, int]:
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
    residual = layer.keys.shape[-2] if _has_kv(layer) else 0
    stored = _quantized_shape(layer._quantized_keys) if layer._quantized_keys is not None else ()
    stored_v = _quantized_shape(layer._quantized_values) if layer._quantized_values is not None else ()
    seen = int(layer.cumulative_length)
    seen_ids: set = set()
    quant_bytes = _tensor_bytes(layer._quantized_keys, seen_ids) + _tensor_bytes(layer._quantized_values, seen_ids)
    residual_bytes = (_storage_bytes(layer.keys) + _storage_bytes(layer.values)) if residual else 0
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


def layer_infos(cache, config_window: int | None = None) -> tuple[LayerInfo, ...]:
    """One LayerInfo per cache layer, from shapes and counters only."""
    reader = _CountReader(cache)
    cache_len = reader.length()
    offloading = bool(getattr(cache, "offloading", False))
    only_non_sliding = bool(getattr(cache, "only_non_sliding", False))
    infos = []
    for index, layer in enumerate(cache.layers):
        kind = _kind(layer)
        if kind == "full" and not offloading and type(layer) not in _NOT_PLAIN:
            info = _plain_info(index, layer)  # most layers of most caches: shapes and storage only
            if info is not None:
                infos.append(info)
                continue
        if kind == "quantized":
            infos.append(_quantized_info(index, layer, offloading))
            continue
        linear = _is_linear(layer)
        states, state_bytes = _linear_states(layer) if linear else ((), 0)
        offloaded = offloading and not linear and kind != "none" and not (only_non_sliding and "sliding" in kind)
        if (
            linear
            and not _has_kv(layer)
            and not hasattr(layer, "max_cache_len")
            and not isinstance(getattr(layer, "keys", None), torch.Tensor)
        ):
            # conv / recurrent state only: it summarizes every token it was fed, in a fixed-size state
            state_kind = _state_kind(cache, layer)
            infos.append(
                LayerInfo(
                    index=index,
                    kind=state_kind,
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
            )
            continue
        if linear:
            kind = f"{kind}+{_state_kind(cache, layer)}"
        keys: Any = getattr(layer, "keys", None)
        values: Any = getattr(layer, "values", None)
        has_states = keys is not None and keys.dim() == 4
        base = kind.split("+")[0]
        seen, filled = _layer_counts(layer, base, reader)
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
                bytes=(_storage_bytes(keys) + _storage_bytes(values) if has_states else 0) + state_bytes,
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


_NOT_PLAIN: set[type] = set()  # layer classes with more than K/V (linear states, ...): the general path
_TEXT: dict[object, str] = {}  # torch.dtype / torch.device -> its name in a LayerInfo


def _text(value) -> str:
    text = _TEXT.get(value)
    if text is None:
        text = _TEXT[value] = str(value).removeprefix("torch.")
    return text


def _plain_info(index: int, layer) -> LayerInfo | None:
    """A full-attention layer that holds only K and V (the general path gives the same LayerInfo)."""
    if _is_linear(layer) or _is_quantized(layer):
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
        _storage_bytes(keys) + _storage_bytes(values),
        slots,
        None,
        None,
        slots,
        0,
    )


def static_capacity(cache) -> int | None:
    """Tokens a static cache can take before its full-attention layers overflow; None if it cannot."""
    full_static = [int(layer.max_cache_len) for layer in cache.layers if _layer_kind(layer) == "static"]
    return min(full_static) if full_static else None


def truncate_blocker(cache, new_length: int) -> str | None:
    """Why the cache cannot be cut back to `new_length` tokens in place, or None if it can.

    "sliding": a sliding layer evicted states that are needed; "state": a conv / recurrent (SSM,
    linear-attention) state summarizes every token and has no past to go back to (transformers'
    past recording keeps conv windows only, not recurrent states); "quantized": the quantized part
    cannot be cut per token. The caller recomputes from the token buffer then."""
    reader = _CountReader(cache)
    if new_length >= reader.length():
        return None
    for layer in cache.layers:
        if _is_linear(layer) and not _linear_croppable(layer):
            return "state"
        kind = _layer_kind(layer)
        if kind == "quantized":
            return "quantized"
        if kind in ("sliding", "static-sliding"):
            seen, filled = _layer_counts(layer, kind, reader)
            if seen > new_length and filled < seen:  # evicted states cannot come back
                return "sliding"
    return None


def _linear_croppable(layer) -> bool:
    """A conv-only layer recording its past can be cropped exactly; a recurrent state never can."""
    if not getattr(layer, "record_past", False):
        return not any(t is not None for t in list(layer.conv_states.values()) + list(layer.recurrent_states.values()))
    return not any(t is not None for t in layer.recurrent_states.values())


def can_truncate(cache, new_length: int) -> bool:
    """Whether every layer still holds the states of positions [0, new_length) and can be cut back to them."""
    return truncate_blocker(cache, new_length) is None


def has_linear_layers(cache) -> bool:
    return any(_is_linear(layer) for layer in cache.layers)


def records_past(cache) -> bool:
    """Whether a linear layer of this cache records its past (so a crop is exact)."""
    return any(_is_linear(layer) and getattr(layer, "record_past", False) for layer in cache.layers)


def activate_past_recording(cache) -> bool:
    """Turn on transformers' past recording when every linear layer is conv-only (LFM2): crops are exact then.

    Returns whether it was turned on. Layers with a recurrent state gain nothing from it (their crop
    cannot go back), so those caches are left as they are and rewinds recompute instead."""
    linear = [layer for layer in cache.layers if _is_linear(layer)]
    if not linear or not hasattr(cache, "activate_past_recording") or getattr(cache, "_kvtui_state_kind", None):
        return False  # no linear layers, an old transformers, or a known recurrent (ssm / linear) state
    cache.activate_past_recording()
    return True


def truncate(cache, new_length: int) -> None:
    """Drop every state at position >= new_length. Call `can_truncate` first."""
    with torch.inference_mode():  # the states were written under inference mode
        _truncate_layers(cache, new_length)


def _truncate_layers(cache, new_length: int) -> None:
    reader = _CountReader(cache)  # every counter is read before its own layer is cut
    cache_len = reader.length()
    for layer in cache.layers:
        if _is_linear(layer) and not _has_kv(layer):
            layer.crop(-(cache_len - new_length))  # conv-only with past recording (see truncate_blocker)
            continue
        kind = _layer_kind(layer)
        seen, _ = _layer_counts(layer, kind, reader)
        remove = seen - new_length
        if remove <= 0:
            continue
        if kind in ("full", "sliding"):
            layer.crop(-remove)  # negative = remove n, in 4.5x and 5.x alike
        else:
            _truncate_static(layer, new_length)


def _truncate_static(layer, new_length: int) -> None:
    # StaticLayer has no crop: move its counters back and zero the stale slots (4.x counts non-zero slots).
    layer.keys[:, :, new_length:, :].zero_()
    layer.values[:, :, new_length:, :].zero_()
    if hasattr(layer, "cumulative_length_int"):
        layer.cumulative_length_int = new_length
    counter = getattr(layer, "cumulative_length", None)
    if isinstance(counter, torch.Tensor):
        counter.fill_(new_length)
    elif counter is not None:
        layer.cumulative_length = new_length


def attention_heads(config) -> tuple[int | None, int | None]:
    """(query heads, KV heads) from the text config, for the layers pane's totals."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    query = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", None)
    kv = getattr(text, "num_key_value_heads", None) or query
    return query, kv


def config_window(config) -> int | None:
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return getattr(text, "sliding_window", None)


# ---- fingerprints: has the cache changed between two forwards? (kvtui watch) ------------------------


_KINDS: dict[type, str] = {}  # layer class -> its kind (a class attribute in every version kvtui reads)


def _kind(layer) -> str:
    kind = _KINDS.get(type(layer))
    if kind is None:
        kind = _KINDS[type(layer)] = _layer_kind(layer)
    return kind


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

    def release(self) -> None:
        self.layers, self.views, self.values = [], [], []

    def rows(self) -> tuple:
        """(kind, seen, K shape, K/V addresses[, write counters]) per layer, as they were."""
        out: list[tuple] = []
        for layer, keys, values, counter, versions in self.layers:
            kind = _kind(layer)
            if not _kv_tensors(keys, values):
                out.append((kind, -1))
                continue
            seen = keys.shape[-2] if counter is None else counter
            out.append((kind, seen, keys.shape, keys.data_ptr(), values.data_ptr()) + (versions or ()))
        return tuple(out)


def _kv_tensors(keys, values) -> bool:
    return isinstance(keys, torch.Tensor) and keys.dim() == 4 and isinstance(values, torch.Tensor)


def _counter(layer, kind: str, keys, reader: _CountReader) -> tuple[int | None, int]:
    """(its token counter, None for a full layer whose slots are its tokens; filled slots)."""
    if kind == "full":
        return None, keys.shape[-2]
    return _layer_counts(layer, kind, reader)


def fingerprint(cache) -> Fingerprint:
    """The cache now, in O(layers) attribute reads (plus two end-slot views per inference layer):
    no K/V copy, no transfer to the host."""
    layers: list[tuple] = []
    views = []
    reader = _CountReader(cache)
    for index, layer in enumerate(getattr(cache, "layers", ())):
        keys: Any = getattr(layer, "keys", None)
        values: Any = getattr(layer, "values", None)
        if not _kv_tensors(keys, values):
            layers.append((layer, keys, values, None, None))
            continue
        counter, filled = _counter(layer, _kind(layer), keys, reader)
        if keys.is_inference() or values.is_inference():
            versions = None
            if filled > 0:  # slots 0 and filled-1 (views, no copy)
                ends = slice(0, filled, max(1, filled - 1))
                views += [(index, keys[:, :, ends]), (index, values[:, :, ends])]
        else:  # autograd's counter of in-place writes: free to read
            versions = (keys._version, values._version)
        layers.append((layer, keys, values, counter, versions))
    return Fingerprint(layers, views, _stack(views))


def _stack(views: list) -> list:
    """One stacked copy of the views: all in one when they are alike (the usual case: one call), else
    grouped by shape, dtype and device."""
    if not views:
        return []
    try:
        return [(list(range(len(views))), torch.stack([view for _, view in views]))]
    except RuntimeError:  # layers of different shapes (MLA K vs V, sliding windows) or devices
        groups: dict[tuple, list[int]] = {}
        for i, (_, view) in enumerate(views):
            groups.setdefault((view.shape, view.dtype, view.device), []).append(i)
        return [(indices, torch.stack([views[i][1] for i in indices])) for indices in groups.values()]


def _same(entry, layer, reader: _CountReader) -> bool:
    held, keys, values, counter, versions = entry
    if layer is not held or getattr(layer, "keys", None) is not keys or getattr(layer, "values", None) is not values:
        return False
    if not _kv_tensors(keys, values):
        return True
    if counter is not None and _counter(layer, _kind(layer), keys, reader)[0] != counter:
        return False
    return versions is None or versions == (keys._version, values._version)  # type: ignore[union-attr]  # _kv_tensors


def changed(before: Fingerprint, cache) -> str | None:
    """What the program did to the cache since `before` was taken, in words; None if nothing. Releases
    `before` (it is spent)."""
    try:
        layers = list(getattr(cache, "layers", ()))
        reader = _CountReader(cache)
        if len(layers) != len(before.layers) or not all(
            _same(e, layer, reader) for e, layer in zip(before.layers, layers)
        ):
            change = describe_change(before.rows(), _rows(cache))  # None: replaced by equal ones (a no-op)
            if change is not None:
                return change
        edited: set[int] = set()
        for indices, copy in before.values:
            now = torch.stack([before.views[i][1] for i in indices])  # the same slots, read again
            if not torch.equal(now, copy):
                differs = (now != copy).reshape(len(indices), -1).any(dim=1).tolist()
                edited.update(before.views[i][0] for i, d in zip(indices, differs) if d)
        if edited:
            return f"K/V values edited in place in {_layer_list(sorted(edited), len(layers))}"
        return None
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

"""The one module that knows transformers' cache internals, and how they differ between versions.

Everything here reads `.shape`, `.dtype`, counters and class names: O(layers), no K/V copies.
`truncate` also writes those internals (static caches have no `crop`), but only `session.py` calls it:
the session stays the one place that decides when the cache changes.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

import torch
import transformers
from transformers import DynamicCache, StaticCache

from .snapshot import LayerInfo


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


TRANSFORMERS_VERSION = _version(transformers.__version__)


def make_cache(kind: str, config, max_cache_len: int | None = None):
    """A fresh cache of the kind asked for, with per-layer types from the config (sliding or full)."""
    if kind == "dynamic":
        try:
            return DynamicCache(config=config)
        except TypeError:  # very old signature: full layers only
            return DynamicCache()
    if kind == "static":
        if not max_cache_len or max_cache_len < 1:
            raise ValueError("a static cache needs --max-cache-len N (N >= 1)")
        return StaticCache(config=config, max_cache_len=max_cache_len)
    raise ValueError(f"unknown cache kind {kind!r}: use dynamic or static")


def seq_length(cache) -> int:
    """Tokens the cache has seen (5.x StaticCache returns a 0-dim tensor: hence int())."""
    return int(cache.get_seq_length())


@lru_cache(maxsize=64)
def _forward_parameters(forward) -> frozenset[str]:
    return frozenset(inspect.signature(forward).parameters)


def forward_accepts(model, name: str) -> bool:
    """From 5.4 models take no `cache_position` and silently ignore one; 4.x needs it for static caches."""
    return name in _forward_parameters(type(model).forward)


def _layer_kind(layer) -> str:
    static = hasattr(layer, "max_cache_len")
    sliding = bool(getattr(layer, "is_sliding", False)) or "Sliding" in type(layer).__name__
    if static:
        return "static-sliding" if sliding else "static"
    return "sliding" if sliding else "full"


def _storage_bytes(tensor) -> int:
    # The storage, not the view: a cropped dynamic layer still holds its larger buffer until the next cat.
    if tensor is None:
        return 0
    try:
        return tensor.untyped_storage().nbytes()
    except (AttributeError, RuntimeError):
        return tensor.numel() * tensor.element_size()


def _static_counter(layer) -> int | None:
    """Tokens written into a static layer, read from its counter (5.x) or None if it has none (4.x)."""
    if hasattr(layer, "cumulative_length_int"):
        return int(layer.cumulative_length_int)
    counter = getattr(layer, "cumulative_length", None)
    return None if counter is None else int(counter)


def _layer_counts(layer, kind: str, cache_len: int) -> tuple[int, int]:
    """(seen, filled): tokens fed to this layer in total, and slots holding real states now."""
    keys = getattr(layer, "keys", None)
    initialized = keys is not None and getattr(layer, "is_initialized", True) and keys.dim() == 4
    slots = keys.shape[-2] if initialized else 0
    if kind == "full":
        return slots, slots
    if kind == "sliding":
        seen = int(getattr(layer, "cumulative_length", slots))
        return seen, slots
    # static layers hold max_cache_len slots whatever is written: the counter is the truth.
    counter = _static_counter(layer) if initialized else 0
    seen = cache_len if counter is None else counter
    return seen, min(seen, slots)


def layer_infos(cache, config_window: int | None = None) -> tuple[LayerInfo, ...]:
    """One LayerInfo per cache layer, from shapes and counters only."""
    cache_len = seq_length(cache)
    infos = []
    for index, layer in enumerate(cache.layers):
        kind = _layer_kind(layer)
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        has_states = keys is not None and keys.dim() == 4
        seen, filled = _layer_counts(layer, kind, cache_len)
        if kind == "full":
            capacity, window = None, None
        elif kind == "sliding":
            window = int(getattr(layer, "sliding_window", config_window or 0)) or None
            capacity = window - 1 if window else None  # it keeps the last window-1 between steps
        else:
            capacity = int(layer.max_cache_len)
            window = capacity if kind == "static-sliding" else None
        infos.append(
            LayerInfo(
                index=index,
                kind=kind,
                k_shape=tuple(keys.shape) if has_states else (),
                v_shape=tuple(values.shape) if has_states else (),
                dtype=str(keys.dtype).removeprefix("torch.") if has_states else "-",
                device=str(keys.device) if has_states else "-",
                bytes=_storage_bytes(keys) + _storage_bytes(values) if has_states else 0,
                filled=filled,
                capacity=capacity,
                window=window,
                seen=seen,
                held_from=seen - filled,
            )
        )
    return tuple(infos)


def static_capacity(cache) -> int | None:
    """Tokens a static cache can take before its full-attention layers overflow; None if it cannot."""
    full_static = [int(layer.max_cache_len) for layer in cache.layers if _layer_kind(layer) == "static"]
    return min(full_static) if full_static else None


def can_truncate(cache, new_length: int) -> bool:
    """Whether every layer still holds the states of positions [0, new_length)."""
    for layer in cache.layers:
        kind = _layer_kind(layer)
        if kind in ("sliding", "static-sliding"):
            seen, filled = _layer_counts(layer, kind, seq_length(cache))
            if seen > new_length and filled < seen:  # evicted states cannot come back
                return False
    return True


def truncate(cache, new_length: int) -> None:
    """Drop every state at position >= new_length. Call `can_truncate` first."""
    with torch.inference_mode():  # the states were written under inference mode
        _truncate_layers(cache, new_length)


def _truncate_layers(cache, new_length: int) -> None:
    cache_len = seq_length(cache)
    for layer in cache.layers:
        kind = _layer_kind(layer)
        seen, _ = _layer_counts(layer, kind, cache_len)
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


def fingerprint(cache) -> tuple:
    """Per layer (tokens seen, K shape, K/V storage addresses, sums of the first and last filled slot).

    O(layers): the sums reduce one slot per layer on its device and come back in one transfer, so an
    in-place write at either end, a crop, a reset or replaced tensors all change it."""
    cache_len = seq_length(cache)
    rows, probes = [], []
    for layer in getattr(cache, "layers", ()):
        kind = _layer_kind(layer)
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not (isinstance(keys, torch.Tensor) and keys.dim() == 4 and isinstance(values, torch.Tensor)):
            rows.append((kind, -1, (), 0, 0))
            continue
        seen, filled = _layer_counts(layer, kind, cache_len)
        rows.append((kind, seen, tuple(keys.shape), keys.data_ptr(), values.data_ptr()))
        if filled > 0:
            for index in (0, filled - 1):
                probes.append(keys.narrow(-2, index, 1).float().sum() + values.narrow(-2, index, 1).float().sum())
        else:
            probes.extend([keys.new_zeros((), dtype=torch.float32)] * 2)
    sums = torch.stack(probes).tolist() if probes else []
    out, cursor = [], 0
    for row in rows:
        if row[1] < 0:
            out.append(row + (None, None))
        else:
            out.append(row + (sums[cursor], sums[cursor + 1]))
            cursor += 2
    return tuple(out)


def describe_change(before: tuple, after: tuple) -> str | None:
    """What changed between two fingerprints, in words; None if nothing did."""
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

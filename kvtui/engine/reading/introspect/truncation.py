"""Cutting a cache back to a shorter length in place (a rewind), and what stops it.

`truncate` writes the cache's internals (static layers have no `crop`), but only the session calls it:
the session stays the one place that decides when kvtui's cache changes.
"""

from __future__ import annotations

import torch

from .layers import CountReader, has_kv, is_linear, layer_counts, layer_kind


def truncate_blocker(cache, new_length: int) -> str | None:
    """Why the cache cannot be cut back to `new_length` tokens in place, or None if it can.

    "sliding": a sliding layer evicted states that are needed; "state": a conv / recurrent (SSM,
    linear-attention) state summarizes every token and has no past to go back to (transformers'
    past recording keeps conv windows only, not recurrent states); "quantized": the quantized part
    cannot be cut per token. The caller recomputes from the token buffer then."""
    reader = CountReader(cache)
    if new_length >= reader.length():
        return None
    for layer in cache.layers:
        if is_linear(layer) and not _linear_croppable(layer):
            return "state"
        kind = layer_kind(layer)
        if kind == "quantized":
            return "quantized"
        if kind in ("sliding", "static-sliding"):
            seen, filled = layer_counts(layer, kind, reader)
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
    return any(is_linear(layer) for layer in cache.layers)


def records_past(cache) -> bool:
    """Whether a linear layer of this cache records its past (so a crop is exact)."""
    return any(is_linear(layer) and getattr(layer, "record_past", False) for layer in cache.layers)


def activate_past_recording(cache) -> bool:
    """Turn on transformers' past recording when every linear layer is conv-only (LFM2): crops are exact then.

    Returns whether it was turned on. Layers with a recurrent state gain nothing from it (their crop
    cannot go back), so those caches are left as they are and rewinds recompute instead."""
    linear = [layer for layer in cache.layers if is_linear(layer)]
    if not linear or not hasattr(cache, "activate_past_recording") or getattr(cache, "_kvtui_state_kind", None):
        return False  # no linear layers, an old transformers, or a known recurrent (ssm / linear) state
    cache.activate_past_recording()
    return True


def truncate(cache, new_length: int) -> None:
    """Drop every state at position >= new_length. Call `can_truncate` first."""
    with torch.inference_mode():  # the states were written under inference mode
        _truncate_layers(cache, new_length)


def _truncate_layers(cache, new_length: int) -> None:
    reader = CountReader(cache)  # every counter is read before its own layer is cut
    cache_len = reader.length()
    for layer in cache.layers:
        if is_linear(layer) and not has_kv(layer):
            layer.crop(-(cache_len - new_length))  # conv-only with past recording (see truncate_blocker)
            continue
        kind = layer_kind(layer)
        seen, _ = layer_counts(layer, kind, reader)
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

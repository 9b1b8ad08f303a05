"""Compressed caches in a watched program: which positions each layer (and KV head) still holds after a press
inside a forward (kvpress's hooks) or the program's own slicing between forwards, read from the cache's tensors
(`introspect.held`), and said as what it is: an eviction (info), a cut of the tail, or a press that broke the
cache (a layer left empty, K and V kept from different tokens: errors).

Cost: nothing on a forward of a cache that only grows. A prefill (and every forward of a cache already
compressed) keeps references to what each layer's `update` returned (the class patch lives only for that
forward); a layer whose K/V is no longer that tensor was changed inside the forward, and is matched.
"""

from __future__ import annotations

import torch

from ..reading.evictions import eviction_notes, held_from_kept
from ..reading.introspect.held import Held, read_kept
from ..reading.introspect.layers import is_linear, is_quantized, kind_of
from ..records.snapshot import Diagnostic
from .patches import PATCHES, Registry, defining_class, update_wrapper

CAPTURES: Registry[dict] = Registry()  # cache -> {layer index: (K, V) its update returned}, during one forward


def _compressible(cache) -> bool:
    """A cache of full-attention layers holding K/V only (kvpress's caches; layers made lazily count too)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return False
    return all(kind_of(layer) == "full" and not is_linear(layer) and not is_quantized(layer) for layer in layers)


def begin(call, track) -> None:
    """Before a forward: keep what its layers write when it may compress (a prefill, or a compressed cache)."""
    cache = call.cache  # the caller checked: a prefill, or a compressed cache
    if cache is None or not _compressible(cache):
        return
    owner = defining_class(type(cache), "update")
    if owner is None:
        return
    PATCHES.acquire(call, owner, "update", update_wrapper(CAPTURES.get))
    CAPTURES.add(cache, {})
    call.capturing = True


def end(call) -> dict | None:
    """The forward returned or raised: the patch goes, and what its layers wrote comes back."""
    if not call.capturing:
        return None
    call.capturing = False
    written = CAPTURES.get(call.cache)
    CAPTURES.discard(call.cache)
    PATCHES.release(call)
    return written


def _inv_freq(probe) -> torch.Tensor | None:
    for module in probe.positions_read():
        inv_freq = getattr(module, "inv_freq", None)
        if isinstance(inv_freq, torch.Tensor):
            return inv_freq
    return None


def press_name(model) -> str | None:
    """The object whose forward hook sits on an attention module (a kvpress press), by its class name."""
    if model is None:
        return None
    for module in model.modules():
        for hook in getattr(module, "_forward_hooks", {}).values():
            owner = getattr(hook, "__self__", None)
            if owner is not None and not isinstance(owner, torch.nn.Module):
                return type(owner).__name__
    return None


def after_forward(watcher, call, track, cache, step: int) -> list[Diagnostic]:
    """After a forward: a layer changed inside it (a press) gets its held positions read; a compressed cache
    that only grew counts the fed tokens."""
    written = end(call)
    if track is None or cache is not call.cache:
        return []
    held = track.held
    layers = list(getattr(cache, "layers", ()))
    if (
        not written
        or len(written) != len(layers)
        or all(getattr(layer, "keys", None) is written[i][0] for i, layer in enumerate(layers))
    ):  # nothing changed inside the forward: a compressed cache holds what it held, and the fed tokens
        if held is not None:
            held.fed(call.n)
        return []
    logical = held.fed_total if held is not None else written[0][0].shape[-2] - call.n
    fed = list(range(logical, logical + call.n))
    sources = []
    for i in range(len(layers)):
        keys, values = written[i]
        heads = keys.shape[1]
        before = held.positions(i) if held is not None else [list(range(keys.shape[-2] - call.n))] * heads
        sources.append((keys, values, [h + fed for h in before]))
    now = [(layer.keys, layer.values) for layer in layers]
    kept = read_kept(sources, now, _inv_freq(call.probe))
    who = press_name(call.probe.model) or "the forward"
    track.held = held_from_kept(
        kept, logical + call.n, f"{who} at step {step}", rerotated=held is not None and held.rerotated
    )
    return eviction_notes(
        kept, sources, who, f"kept {{kept}} of {logical + call.n} context tokens", step, f" [{call.caller}]"
    )


def unread(call, track, cache, cache_len: int, step: int) -> list[Diagnostic]:
    """A cache that shrank inside a forward kvtui did not expect to compress it (a decoding-time press's first
    round; `cache_len` below what it held before): which positions it kept cannot be read now; from its next
    forward on, every change is read."""
    if not _compressible(cache):
        return []
    layers = list(cache.layers)
    fed = call.cache_length_before + call.n
    slots = [[[-1] * layer.keys.shape[-2]] * layer.keys.shape[1] for layer in layers if hasattr(layer, "keys")]
    who = press_name(call.probe.model) or "the forward"
    track.held = Held(slots=slots, logical=fed, rerotated=False, cause=f"{who} at step {step}")
    text = (
        f"{who} shrank {track.name} inside a decoding forward: {fed} fed tokens, {cache_len} slots held; "
        f"which positions it kept is not known for this first round (kvtui reads them from the next one on)"
    )
    return [Diagnostic("cache-evicted", "info", f"{text} [{call.caller}]", step)]


def between(watcher, call, track, layers_before: list, cache) -> Diagnostic | None:
    """Before a forward: the program shrank the cache since the last one (slicing `layer.keys`, kvpress's pipeline
    dropping an answer). An eviction (not a cut of the tail of an uncompressed cache, which `check_edits` says as a
    crop) is read here, said and returned; None leaves the change to `check_edits`."""
    layers = list(getattr(cache, "layers", ()))
    if len(layers) != len(layers_before) or not layers_before:
        return None
    pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for (old_k, old_v), layer in zip(layers_before, layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not (
            isinstance(old_k, torch.Tensor)
            and isinstance(old_v, torch.Tensor)
            and isinstance(keys, torch.Tensor)
            and isinstance(values, torch.Tensor)
            and old_k.dim() == old_v.dim() == keys.dim() == values.dim() == 4
        ):
            return None
        if keys.shape[-2] > old_k.shape[-2]:
            return None  # grew outside a forward: check_edits says it
        pairs.append((old_k, old_v, keys, values))
    if all(keys.shape[-2] == old_k.shape[-2] for old_k, _, keys, _ in pairs):
        return None  # same length: replaced or edited in place, check_edits' business
    if all(keys.shape[-2] == 0 for _, _, keys, _ in pairs):
        track.held = None  # emptied: a reset, which check_edits says (not a press that left every layer empty)
        return None
    held = track.held
    sources = []
    for i, (old_k, old_v, _, _) in enumerate(pairs):
        heads = old_k.shape[1]
        sources.append(
            (old_k, old_v, held.positions(i) if held is not None else [list(range(old_k.shape[-2]))] * heads)
        )
    kept = read_kept(sources, [(k, v) for _, _, k, v in pairs], _inv_freq(call.probe))
    all_kept = [p for layer in kept for head in layer.positions for p in head if p >= 0]
    all_source = {p for _, _, positions in sources for head in positions for p in head}
    dropped = all_source - set(all_kept)
    logical = held.fed_total if held is not None else max(all_source, default=-1) + 1
    tail_cut = bool(dropped) and max(all_kept, default=-1) < min(dropped)
    in_order = all(head == list(range(len(head))) for layer in kept for head in layer.positions) and not any(
        layer.rerotated or layer.merged or layer.split or layer.unplaced for layer in kept
    )
    if held is None and tail_cut and in_order:
        return None  # a crop of a cache that held what was fed: check_edits says "cropped"
    if tail_cut:  # the tail went (an answer dropped): the buffer ends where the kept ones do
        logical = min(dropped)
        track.truncate(logical)
    rerotated = held is not None and held.rerotated
    track.held = held_from_kept(
        kept, logical, f"the eviction noticed at step {watcher.steps + 1} [{call.caller}]", rerotated=rerotated
    )
    where = f" (noticed at [{call.caller}])"
    said = eviction_notes(
        kept, sources, f"{track.name}: the program", "kept {kept}", watcher.steps + 1, where, tail_cut
    )
    return said[0] if said else None

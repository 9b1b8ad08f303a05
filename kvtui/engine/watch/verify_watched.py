"""Verify for a watched program: the last forward's logits (row 0) against one no-cache forward over what its cache
row was fed (attended tokens, positions 0..n-1), judged as kvtui's own session judges. On a compressed cache the
two differ by design (the press dropped what the recompute sees), so verify reports what the compression cost
(`compression-cost`: top-1 agreement and KL divergence, this step and over the run), never a mismatch."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

from ...fmt import evicted_text
from ..reading import introspect
from ..reading.verify import (
    compression_cost,
    cost_note,
    judge_recompute,
    mismatch_alarm,
    quantized_errors,
    recompute_last_logits,
)
from ..records.codec import to_record, verify_record
from .hooks import STATE


def verify_watched(watcher, snapshot, logits, probe) -> dict:
    """Runs in the program's thread, between two forwards. Refuses (ValueError) what it cannot check."""
    if snapshot is None or logits is None or probe is None:
        raise ValueError("nothing to verify yet: the program has not run a forward")
    unknown = snapshot.cache_unknown
    if unknown:
        raise ValueError(
            f"cannot check {snapshot.cache_id}: its first {unknown} tokens were written before kvtui saw it "
            f"(made before attaching, loaded or copied from an unwatched cache), so a recompute has nothing "
            f"to start from; the {len(snapshot.buffer) - unknown} tokens after them were fed while watched"
        )
    tokens = [t.id for t in snapshot.buffer if t.origin != "pad" and t.id >= 0]
    model = probe.model
    if model is None:
        raise ValueError(f"cannot check {snapshot.cache_id}: the program has let go of its model ({probe.name})")
    # a quantized cache (still alive): the recompute keeps its full-precision K/V, to say each layer's error
    quantized = watcher._last_quantized() if watcher._last_quantized is not None else None
    reference: list | None = [] if quantized is not None else None  # gets the recompute's own cache
    compressed = any(layer.held is not None for layer in snapshot.layers)
    capture = probe.attention  # --attention: the recompute's newest query is recorded as any forward's
    if capture is not None:
        capture.clear()
    STATE.stack.append(None)  # kvtui's own forward, not one of the program's: no step, never held by the gate
    try:
        with _hooks_set_aside(model):
            fresh, ms = recompute_last_logits(model, tokens, kept=reference)
    finally:
        STATE.stack.pop()
    dtype = str(model.dtype).removeprefix("torch.")
    quant_bits = next((layer.quant_bits for layer in snapshot.layers if layer.quant_bits), None)
    result = judge_recompute(logits, fresh, dtype, watcher.top_k, len(tokens), ms, quant_bits)
    if (
        reference and reference[0] is not None
    ):  # per layer (nan where the program's cache holds other slots than its tokens')
        result = replace(result, layer_errors=quantized_errors(quantized, reference[0]))
    evicted = None
    if capture is not None:  # the recompute's rows are no step's: measured here (compressed, no pads) or dropped
        pads = len(tokens) != len(snapshot.buffer)
        if compressed and not pads:
            evicted = capture.shares_outside([_held_sets(layer, model) for layer in snapshot.layers])
        capture.clear()
    if compressed:
        kl, top1 = compression_cost(logits, fresh)
        result = replace(result, ok=True, compressed_kl=kl, compressed_top1=top1, evicted_attention=evicted)
        watcher.compression_costs.append((kl, top1))
        held = max((layer.filled for layer in snapshot.layers), default=0)
        note = cost_note(watcher.compression_costs, snapshot.cache_id, held, len(tokens), watcher.steps)
        watcher._diagnose([replace(note, message=note.message + evicted_text(evicted))])
    elif not result.ok:
        watcher._diagnose([mismatch_alarm(result, f"the program's cached logits ({snapshot.cache_id})", watcher.steps)])
    if watcher.recorder is not None:
        watcher.recorder.record(verify_record(result, watcher.steps))
    return to_record(result)


def _held_sets(layer, model) -> list[set[int]] | None:
    """A compressed layer's held positions per KV head (the same for every head where heads do not differ); None
    for a layer that holds everything it was fed."""
    if layer.held is None:
        return None
    runs = layer.held_heads or (layer.held,) * (introspect.attention_heads(model.config)[1] or 1)
    return [{p for start, stop in head for p in range(start, stop)} for head in runs]


@contextmanager
def _hooks_set_aside(model):
    """The model as it computes without the forward hooks the program registered (a kvpress press compresses, and
    reads a cache the recompute does not have): each module's hook dicts emptied for kvtui's one forward and
    refilled with the same entries in the same order (their handles stay valid). The program is held between two
    of its forwards in this thread, so nothing of it runs meanwhile. The keys a press masked per head
    (`masked_key_indices`: kvpress's attention patch clears them at any prefill, kvtui's recompute included) are put
    back as the same object."""
    held = []
    masked = []
    for module in model.modules():
        for hooks in (module._forward_hooks, module._forward_pre_hooks):
            if hooks:
                held.append((hooks, list(hooks.items())))
                hooks.clear()
        if "masked_key_indices" in module.__dict__:
            masked.append((module.__dict__, module.__dict__["masked_key_indices"]))
    try:
        yield
    finally:
        for hooks, items in held:
            hooks.clear()
            hooks.update(items)
        for state, indices in masked:
            state["masked_key_indices"] = indices

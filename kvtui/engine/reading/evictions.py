"""An eviction in words and in held positions, for any cache a press shrank: a watched program's (watch/evictions.py)
and kvtui's own chat under `--press` (chat/press.py). Both read what each layer kept with `introspect.held.read_kept`
(the one reader); this turns what it found into the `Held` value the rules and the panes use and into the one
`cache-evicted` line (info), or the error a broken press earns."""

from __future__ import annotations

from itertools import chain

from ...fmt import runs_text
from ..records.snapshot import Diagnostic
from .introspect.held import Held, LayerKept, count, ranges


def held_from_kept(kept: list[LayerKept], logical: int, cause: str, rerotated: bool) -> Held | None:
    """What a shrink left, as held positions (None: every fed token is held in order, a plain cache again)."""
    slots = [layer.positions for layer in kept]
    if all(head == list(range(logical)) for layer in slots for head in layer):
        return None  # everything fed is held, in order: a plain cache again
    rerotated = rerotated or any(layer.rerotated_to_slots for layer in kept)
    return Held(slots=slots, logical=logical, rerotated=rerotated, cause=cause)


def eviction_notes(
    kept: list[LayerKept], sources: list, who: str, verb: str, step: int, at: str, tail_cut: bool = False
) -> list[Diagnostic]:
    """The eviction in words: one info line (what every layer kept, or the layers that differ), or the error a
    broken press earns (a layer left empty, K and V from different tokens)."""
    empty = [i for i, layer in enumerate(kept) if not layer.positions or not layer.positions[0]]
    split = [(i, layer.split) for i, layer in enumerate(kept) if layer.split]
    if empty:
        shown = ", ".join(map(str, empty[:6]))
        return [Diagnostic("cache-evicted", "error", f"{who} left {len(empty)} layer(s) empty ({shown}){at}", step)]
    if split:
        i, n = split[0]
        return [
            Diagnostic(
                "cache-evicted",
                "error",
                f"{who} kept different tokens for K and V in {n} slots of layer {i}"
                + (f" (and {len(split) - 1} more layers)" if len(split) > 1 else "")
                + at,
                step,
            )
        ]
    runs = [ranges(chain.from_iterable(layer.positions)) for layer in kept]
    source_count = len({p for head in sources[0][2] for p in head})
    dropped = source_count - count(runs[0])
    slot_counts = {len(layer.positions[0]) for layer in kept}
    heads_differ = any(len({tuple(sorted(h)) for h in layer.positions}) > 1 for layer in kept)
    if heads_differ and len(slot_counts) == 1 and not tail_cut:  # a per-head press (ScorerPress's top-k per head)
        per_head = slot_counts.pop()
        text = (
            f"{who} {verb.format(kept=per_head)} per KV head in every layer, each head its own ones "
            f"(layer 0's heads together hold {count(runs[0])}: {runs_text(runs[0], 4, sentence=True)})"
        )
    elif all(r == runs[0] for r in runs):
        verb_text = verb.format(kept=count(runs[0]))
        text = (
            f"{who} cut the tail: every layer holds {runs_text(runs[0], 4, sentence=True)}"
            if tail_cut
            else f"{who} evicted {dropped} tokens from every layer, {verb_text}: {runs_text(runs[0], 4, sentence=True)}"
        )
    else:
        sizes = sorted({count(r) for r in runs})
        keep = f"{sizes[0]} tokens each, not the same ones" if len(sizes) == 1 else f"{sizes[0]}–{sizes[-1]} tokens"
        text = (
            f"{who} evicted per layer: layers keep {keep} "
            f"(layer 0 {verb.format(kept=count(runs[0]))}: {runs_text(runs[0], 4, sentence=True)})"
        )
    differing = [i for i, layer in enumerate(kept) if len({tuple(sorted(h)) for h in layer.positions}) > 1]
    if differing and "per KV head" not in text:
        text += f"; heads keep different positions in {len(differing)} of {len(kept)} layers"
    rerotated = sum(layer.rerotated for layer in kept)
    if rerotated:
        to_slots = all(layer.rerotated_to_slots for layer in kept if layer.rerotated)
        text += f"; {rerotated} kept keys re-rotated " + (
            "to their slots' positions (0..held-1)" if to_slots else "(to positions kvtui could not read)"
        )
    merged = sum(layer.merged for layer in kept)
    if merged:
        text += f"; {merged} kept values changed (merged)"
    return [Diagnostic("cache-evicted", "info", text + at, step)]

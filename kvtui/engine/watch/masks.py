"""Keys a press masks per KV head without dropping them (kvpress's AdaKVPress, CriticalAdaKVPress, DuoAttentionPress,
DMSPress…): the press keeps the cache's length and leaves `module.masked_key_indices = (batch, head, slot)` on each
attention module; kvpress's attention patch then overwrites those keys with a fake key of attention weight 0 on every
later forward, until the next prefill clears them. kvtui reads that state after each forward (never sets or changes
it) and takes the masked slots out of what each KV head holds (`held.Masked`, `LayerInfo.held_heads`).

Cost: a step where no attention module carries masked keys, or where they are the objects read before, is one dict
lookup per layer on the host; new masks ride the step's one transfer (`HostReads`). (Index tensors a press edits in
place, keeping the object, are not seen: kvpress's presses set a new tuple or list each time.)"""

from __future__ import annotations

import operator
import weakref
from operator import attrgetter, methodcaller

import torch

from ...fmt import runs_text
from ..reading.introspect.held import Masked, ranges
from ..records.snapshot import Diagnostic
from .evictions import press_name
from .watch_step import Call

HEADS_SHOWN = 4  # heads whose kept positions the note spells out


_HOOKS = attrgetter("_forward_hooks")
_OWN_STATE = attrgetter("__dict__")
_MASKED = methodcaller("get", "masked_key_indices")  # the instance's own attribute, read without __getattr__
_NONE = {id(None)}


def _live(probe) -> list | None:
    """The attention modules, their weak references called in C (no Python line per layer); None when one is
    gone (then the per-module loop below handles it)."""
    modules = list(map(operator.call, probe.attention_refs))
    return None if None in modules else modules


def press_hooked(probe) -> bool:
    """Whether a forward hook sits on an attention module (a press: it may compress inside any forward, a
    decoding-time press such as DecodingPress among them). O(layers) in C, no device op."""
    modules = _live(probe)
    if modules is not None:
        return any(map(_HOOKS, modules))
    return any(module is not None and module._forward_hooks for module in map(operator.call, probe.attention_refs))


def _state(state) -> tuple | None:
    """A module's masked keys as kvpress leaves them: three index tensors (batch, head, slot), else None."""
    if isinstance(state, (tuple, list)) and len(state) == 3 and all(isinstance(t, torch.Tensor) for t in state):
        return tuple(state)
    return None


def _same(seen: tuple, state) -> bool:
    """The object read before (kvpress sets a new tuple each time: identity and its first tensor, held weakly)."""
    return seen[0] == id(state) and isinstance(state, (tuple, list)) and bool(state) and seen[1]() is state[0]


def stage(call: Call) -> None:
    """After the forward, before the step's transfer: the layers whose masked keys changed (set, replaced or
    cleared), their index tensors registered in the step's reads."""
    seen_all = call.probe.masks_seen
    modules = _live(call.probe)
    if not seen_all and modules is not None and set(map(id, map(_MASKED, map(_OWN_STATE, modules)))) <= _NONE:
        return  # no module carries masked keys, none did (masks_staged stays None): a few lines whatever the layers
    probe = call.probe
    changed: list[tuple[int, object, tuple | None, tuple[int, ...] | None]] = []
    for index, ref in probe.attention_modules:
        module = ref()
        if module is None:
            continue
        raw = module.__dict__.get("masked_key_indices")  # the instance's own attribute, read without __getattr__
        seen = seen_all.get(index)
        if raw is not None and seen is not None and _same(seen, raw):
            continue
        state = _state(raw)
        if state is None:
            if seen is not None:
                changed.append((index, None, None, None))
            continue
        handles = tuple(call.reads.add(t.reshape(-1)) for t in state) if call.reads is not None else None
        changed.append((index, raw, state, handles))
    call.masks_staged = changed or None


def take(call: Call, track, cache, step: int) -> list[Diagnostic]:
    """After the transfer: the track's masked keys updated from what `stage` registered, and the note that says
    them (when new ones were set)."""
    changed, call.masks_staged = call.masks_staged, None
    if not changed or track is None:
        return []
    probe = call.probe
    slots = dict(track.masked.slots) if track.masked is not None else {}
    layers = list(getattr(cache, "layers", ()))
    fresh = []
    for index, raw, state, handles in changed:
        if state is None:
            probe.masks_seen.pop(index, None)
            slots.pop(index, None)
            continue
        probe.masks_seen[index] = (id(raw), weakref.ref(state[0]))
        if handles is not None and call.reads is not None:
            batch, head, slot = (call.reads.flat(h) for h in handles)
        else:
            batch, head, slot = (t.reshape(-1).tolist() for t in state)
        keys = getattr(layers[index], "keys", None) if index < len(layers) else None
        heads = keys.shape[1] if isinstance(keys, torch.Tensor) and keys.dim() == 4 else max(head, default=-1) + 1
        per_head: list[set[int]] = [set() for _ in range(heads)]
        for b, h, s in zip(batch, head, slot):
            if b == 0 and 0 <= h < heads:
                per_head[h].add(s)
        slots[index] = [sorted(h) for h in per_head]
        fresh.append(index)
    who = press_name(probe.model) or "an attention module"
    track.masked = Masked(slots, who) if any(any(h for h in m) for m in slots.values()) else None
    if not fresh or track.masked is None:
        return []
    return [_note(track, layers, fresh, who, step, f" [{call.caller}]")]


def _positions(track, layers: list, index: int) -> list[list[int]]:
    """[heads][slots] the logical position of each slot of the layer (a compressed cache's held ones)."""
    if track.held is not None and index < len(track.held.slots):
        return track.held.positions(index)
    keys = layers[index].keys
    return [list(range(keys.shape[-2]))] * keys.shape[1]


def _note(track, layers: list, fresh: list[int], who: str, step: int, at: str) -> Diagnostic:
    """How many context tokens each KV head lost to the mask, and what the first masked layer's heads keep."""
    masked = track.masked
    counts, context = [], set()
    first = None
    for index in fresh:
        per_head = masked.slots.get(index)
        if not per_head or index >= len(layers) or not isinstance(getattr(layers[index], "keys", None), torch.Tensor):
            continue
        positions = _positions(track, layers, index)
        held = [[p for j, p in enumerate(head) if p >= 0] for head in positions]
        context.add(len(held[0]) if held else 0)
        for head, gone in zip(positions, per_head):
            counts.append(sum(1 for j in gone if j < len(head) and head[j] >= 0))
        if first is None and any(per_head):
            first = (index, positions, per_head)
    average = sum(counts) / len(counts) if counts else 0.0
    of = f"{min(context)}" if len(context) == 1 else f"{min(context, default=0)}–{max(context, default=0)}"
    text = (
        f"{who} masked {average:.3g} of {of} context tokens per KV head on average in {len(fresh)} layer(s) "
        f"(per head {min(counts, default=0)}–{max(counts, default=0)}; the keys stay in their slots and get attention "
        f"weight 0 from the next forward on)"
    )
    if first is not None:
        index, positions, per_head = first
        shown = []
        for h, (head, gone) in enumerate(zip(positions, per_head)):
            if h == HEADS_SHOWN:
                shown.append(f"and {len(positions) - HEADS_SHOWN} more heads")
                break
            out = set(gone)
            kept = ranges(p for j, p in enumerate(head) if j not in out)
            shown.append(f"head {h} keeps {runs_text(kept, 3, sentence=True)}")
        text += f"; layer {index}: " + "; ".join(shown)
    return Diagnostic("cache-evicted", "info", text + at, step)

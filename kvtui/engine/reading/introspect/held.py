"""Held positions: which logical positions (places in the token buffer) each layer and KV head of a compressed cache
still holds, read from the cache's own tensors.

A cache that only grows holds a contiguous run of what was fed, and kvtui describes it by counts alone
(`LayerInfo.held_from..seen`). A press (kvpress, StreamingLLM's sinks + window, a program's own slicing) keeps
some slots and drops others, per layer and per head, in any order. When a layer's slot count is not what the feed
explains, `read_kept` matches every slot the layer holds now against the slots it was built from (its K/V after
the last forward, or what this forward wrote), by the exact bits of each K and V row: a hash of the integer view of
each row, one sort and one search per head on the device, one transfer. So:

- K and V both found at the same source slot: kept as written (its key still encodes its original position);
- V found, K not: the key was re-rotated (KeyRerotationPress), checked against the model's RoPE frequencies;
- K found, V not: the value was merged (CAM-like presses);
- K and V found at different source slots: the press kept different tokens for K and V (an error);
- neither: a slot kvtui cannot place.

Nothing here runs while nothing shrank: a cache that grows as fed costs no extra op, no extra read.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ...records.snapshot import LayerInfo

# the integer type of each float width: a row's bits, compared exactly
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_WEIGHTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _weights(width: int, device: torch.device) -> torch.Tensor:
    """[width] odd int64 multipliers (fixed): a row's hash is sum(bits * weight), exact and order-proof."""
    key = (width, device)
    if key not in _WEIGHTS:
        generator = torch.Generator().manual_seed(0x6B76)
        _WEIGHTS[key] = (torch.randint(1, 2**62, (width,), generator=generator) | 1).to(device)
    return _WEIGHTS[key]


def _hashes(states: torch.Tensor) -> torch.Tensor:
    """[heads, slots] int64: one hash per K or V row of batch row 0 (states [batch, heads, slots, dim])."""
    rows = states[0].detach().contiguous()  # [heads, slots, dim]
    bits = rows.view(_BITS[rows.element_size()]).to(torch.int64)
    return (bits * _weights(rows.shape[-1], rows.device)).sum(-1)


def _find(source: torch.Tensor, now: torch.Tensor) -> torch.Tensor:
    """For each hash in `now` [heads, m], the index of the equal hash in `source` [heads, s], or -1."""
    if source.shape[-1] == 0:
        return torch.full_like(now, -1)
    ordered, order = source.sort(-1)
    at = torch.searchsorted(ordered, now).clamp_(max=source.shape[-1] - 1)
    return torch.where(ordered.gather(-1, at) == now, order.gather(-1, at), -1)


def _rotate(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """`keys` [heads, m, dim] rotated by `delta` [heads, m] positions (RoPE, rotate-half layout, as transformers)."""
    angles = delta.to(torch.float32).unsqueeze(-1) * inv_freq.to(keys.device, torch.float32)  # [heads, m, dim/2]
    emb = torch.cat((angles, angles), -1)
    half = keys.shape[-1] // 2
    rotated_half = torch.cat((-keys[..., half:], keys[..., :half]), -1)
    return (keys.float() * emb.cos() + rotated_half.float() * emb.sin()).to(keys.dtype)


@dataclass
class LayerKept:
    """What one layer holds after a shrink: per KV head, each slot's logical position (-1: not placed)."""

    positions: list[list[int]]  # [heads][slots]
    rerotated: int = 0  # slots whose key was re-rotated (its value kept as written)
    rerotated_to_slots: bool = False  # the re-rotated keys encode their slot index (checked against RoPE)
    merged: int = 0  # slots whose value changed while its key was kept
    split: int = 0  # slots whose K and V came from different tokens
    unplaced: int = 0


def read_kept(
    sources: list[tuple[torch.Tensor, torch.Tensor, list[list[int]]]],
    layers: list[tuple[torch.Tensor, torch.Tensor]],
    inv_freq: torch.Tensor | None = None,
) -> list[LayerKept]:
    """Per layer, what its slots hold now. `sources`: per layer (K, V, positions [heads][slots]) it was built
    from; `layers`: per layer (K, V) now ([batch, heads, slots, dim] each). Row 0 of the batch. O(tokens) on the
    device, one transfer for every layer."""
    found: list[torch.Tensor] = []
    sizes: list[int] = []
    for (src_k, src_v, _), (keys, values) in zip(sources, layers):
        # a key encodes its position (RoPE): unique per slot; a value need not be (layer 0's values of one token id
        # are equal wherever it stands), so V is compared at the slot K names, and searched only where K is not found
        in_k = _find(_hashes(src_k), _hashes(keys))  # [heads, m]
        src_vh, now_vh = _hashes(src_v), _hashes(values)
        v_same = src_vh.gather(-1, in_k.clamp(min=0)) == now_vh if src_vh.shape[-1] else torch.zeros_like(now_vh) > 0
        in_v = _find(src_vh, now_vh)
        parts = [in_k.reshape(-1), v_same.to(torch.int64).reshape(-1), in_v.reshape(-1)]
        if inv_freq is not None:
            parts.append(_rerotated_to_slots(src_k, keys, in_k, in_v, inv_freq).reshape(1))
        sizes.append(in_k.numel())
        found.append(torch.cat(parts))
    host: list[int] = torch.cat(found).tolist() if found else []  # the one transfer
    kept: list[LayerKept] = []
    at = 0
    for (_, _, positions), (keys, _), size in zip(sources, layers, sizes):
        heads, slots = keys.shape[1], keys.shape[2]
        k_at, v_ok, v_at = host[at : at + size], host[at + size : at + 2 * size], host[at + 2 * size : at + 3 * size]
        at += 3 * size
        checked = False
        if inv_freq is not None:
            checked = bool(host[at])
            at += 1
        layer = LayerKept([[-1] * slots for _ in range(heads)])
        for head in range(heads):
            source, out = positions[head], layer.positions[head]
            for slot in range(slots):
                i = head * slots + slot
                k, v = k_at[i], v_at[i]
                if k >= 0:
                    out[slot] = source[k]
                    if not v_ok[i]:
                        if v >= 0:  # V is another token's
                            layer.split += 1
                        else:
                            layer.merged += 1
                elif v >= 0:  # V kept as written, K changed: re-rotated
                    out[slot] = source[v]
                    layer.rerotated += 1
                else:
                    layer.unplaced += 1
        layer.rerotated_to_slots = checked and layer.rerotated > 0
        kept.append(layer)
    return kept


def _rerotated_to_slots(
    src_k: torch.Tensor, keys: torch.Tensor, in_k: torch.Tensor, in_v: torch.Tensor, inv_freq: torch.Tensor
) -> torch.Tensor:
    """1 when every re-rotated key (V found, K not) equals its source key rotated to the slot it sits in (the
    kept keys then encode positions 0..m-1, as KeyRerotationPress and a sink cache write them), else 0. The source
    slot index is its position within the source (the caller's positions map it to the buffer)."""
    moved = (in_k < 0) & (in_v >= 0)  # [heads, m]
    if not bool(moved.any()):  # no re-rotated slot: nothing to check (a sync only on a shrink)
        return torch.zeros((), dtype=torch.int64, device=keys.device)
    heads, slots = in_v.shape
    source = src_k[0].gather(1, in_v.clamp(min=0).unsqueeze(-1).expand(-1, -1, src_k.shape[-1]))  # [heads, m, dim]
    slot_index = torch.arange(slots, device=keys.device).expand(heads, slots)
    expected = _rotate(source, slot_index - in_v, inv_freq)
    close = torch.isclose(expected.float(), keys[0].float(), rtol=1e-3, atol=1e-4).all(-1)  # [heads, m]
    return (close | ~moved).all().to(torch.int64)


def ranges(positions) -> tuple[tuple[int, int], ...]:
    """Sorted positions as half-open runs: [0, 1, 2, 3, 315, 316] -> ((0, 4), (315, 317))."""
    out: list[list[int]] = []
    for p in sorted(set(positions)):
        if p < 0:
            continue
        if out and out[-1][1] == p:
            out[-1][1] = p + 1
        else:
            out.append([p, p + 1])
    return tuple((a, b) for a, b in out)


def count(runs: tuple[tuple[int, int], ...]) -> int:
    return sum(b - a for a, b in runs)


@dataclass
class Held:
    """A compressed cache's held positions: per layer, per KV head, the logical position of each slot (in slot
    order: what the next shrink is matched against), plus the tokens fed since it was read (every layer holds
    them, appended after its kept slots)."""

    slots: list[list[list[int]]]  # [layer][head][slot] at the last read
    logical: int  # tokens fed into the cache when read (the buffer's length)
    rerotated: bool  # the kept keys were re-rotated to their slot positions (they encode 0..m-1)
    cause: str  # the eviction, in words (said with a position-gap it explains)
    appended: int = 0  # tokens fed since (every layer holds them after its kept slots)
    _runs: list = field(default_factory=list)  # per layer: (union runs, per-head runs or None) of `slots`

    def __post_init__(self):
        self._runs = []
        for heads in self.slots:
            per_head = tuple(ranges(h) for h in heads)
            union = ranges(p for h in heads for p in h)
            self._runs.append((union, per_head if len(set(per_head)) > 1 else None))

    def expected_next(self, slots: int) -> int:
        """Where the next fed token must go: the position the kept keys continue. Kept as written, each key
        encodes the position it was fed at, so the logical length; re-rotated to its slot, the slot count."""
        return slots if self.rerotated else self.logical + self.appended

    @property
    def fed_total(self) -> int:
        return self.logical + self.appended

    def fed(self, n: int) -> None:
        self.appended += n

    def positions(self, layer: int) -> list[list[int]]:
        """[heads][slots] of the layer now (its kept slots, then what was fed since)."""
        tail = list(range(self.logical, self.logical + self.appended))
        return [h + tail for h in self.slots[layer]]

    def runs(self, layer: int) -> tuple[tuple[tuple[int, int], ...], tuple | None]:
        """(the positions any head of the layer holds, per-head runs where heads differ) as half-open runs."""
        union, per_head = self._runs[layer]
        if not self.appended:
            return union, per_head
        tail = (self.logical, self.logical + self.appended)
        return _extend(union, tail), (tuple(_extend(h, tail) for h in per_head) if per_head else None)


def _extend(runs: tuple[tuple[int, int], ...], tail: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    if runs and runs[-1][1] == tail[0]:
        return runs[:-1] + ((runs[-1][0], tail[1]),)
    return runs + (tail,)


def held_infos(infos: tuple[LayerInfo, ...], held: Held) -> tuple[LayerInfo, ...]:
    """The layers' infos with what a compressed cache holds: `seen` the tokens fed, `held` the runs of positions
    (per head where heads differ), `held_from` the first one held."""
    out = []
    for info in infos:
        if info.index >= len(held.slots):
            out.append(info)
            continue
        union, per_head = held.runs(info.index)
        out.append(
            replace(
                info,
                seen=held.fed_total,
                held_from=union[0][0] if union else held.fed_total,
                held=union,
                held_heads=per_head,
            )
        )
    return tuple(out)


@dataclass
class Masked:
    """Keys a press masked per KV head (kvpress's `module.masked_key_indices`: AdaKVPress, CriticalAdaKVPress,
    DuoAttentionPress…): they keep their slots and the positions they encode, and attention gives them weight 0
    from the next forward on. What each head then holds is worked out once per change of the masks or of the
    positions under them (O(slots), on the host), then extended by the tokens fed since (every head holds those):
    O(layers x heads) a step."""

    slots: dict[int, list[list[int]]]  # layer -> per KV head, the masked slot indices (batch row 0), sorted
    who: str  # the press (or module) that masked them, in words
    # layer -> (the Held it was worked out on, the tokens fed then, per-head runs, union runs, slots then, whether
    # heads differ)
    _bases: dict = field(default_factory=dict)

    def base(self, info: LayerInfo, held: Held | None) -> tuple[tuple, tuple, int, bool]:
        """(per-head runs, union runs, tokens fed when worked out, whether heads differ) of the layer's unmasked
        positions."""
        known = self._bases.get(info.index)
        if known is not None and known[0] is held and _only_grew(known, info, held):
            return known[2], known[3], known[1], known[5]
        heads = info.k_shape[1] if len(info.k_shape) == 4 else len(self.slots[info.index])
        if held is not None and info.index < len(held.slots):
            positions = held.positions(info.index)
        else:
            positions = [list(range(info.held_from, info.held_from + info.filled))] * heads
        masked = self.slots[info.index]
        per_head = []
        for head, slots in enumerate(positions):
            gone = set(masked[head]) if head < len(masked) else set()
            per_head.append(ranges(p for j, p in enumerate(slots) if j not in gone))
        union = ranges(p for head in per_head for a, b in head for p in range(a, b))
        differ = len(set(per_head)) > 1
        self._bases[info.index] = (held, info.seen, tuple(per_head), union, info.filled, differ)
        return tuple(per_head), union, info.seen, differ


def _only_grew(known: tuple, info: LayerInfo, held: Held | None) -> bool:
    """Whether the layer only had tokens appended since its base was worked out (a compressed cache's Held is
    replaced on every shrink; a plain cache grew by as many slots as tokens fed)."""
    grown = info.seen - known[1]
    return grown >= 0 and (held is not None or info.filled - known[4] == grown)


def masked_infos(infos: tuple[LayerInfo, ...], masked: Masked, held: Held | None) -> tuple[LayerInfo, ...]:
    """The layers' infos with the keys a press masked taken out of what each KV head holds (`held_heads`; `held`
    the positions any head still attends). Slots and `filled` are unchanged: masked keys stay in memory."""
    out = []
    for info in infos:
        if not masked.slots.get(info.index):
            out.append(info)
            continue
        per_head, union, end, differ = masked.base(info, held)
        if info.seen > end:  # the tokens fed since: every head holds them
            tail = (end, info.seen)
            per_head = tuple(_extend(h, tail) for h in per_head)
            union = _extend(union, tail)
        out.append(
            replace(
                info,
                held=union,
                held_heads=per_head if differ else None,
                held_from=union[0][0] if union else info.seen,
            )
        )
    return tuple(out)

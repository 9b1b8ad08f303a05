"""What each step attends to: the newest query's attention over what every layer holds, captured around
transformers' own attention functions, whatever the implementation (sdpa, eager, flex, flash), never by
switching the model to eager.

How: every attention call goes through `AttentionInterface._global_mapping[impl]` (sdpa, flex, flash...) or
the modeling module's `eager_attention_forward`; the layer has already written its cache and hands the function
the whole K/V it holds and the mask. kvtui replaces those entries with a wrapper that calls the original with
the very same arguments (its output is returned untouched: bit-identical) and, for an attention module of a
captured model (kvtui's own weak registry, nothing on the model), computes on the device the newest query's
softmax row per head of batch row 0: O(heads x held) per layer, as cheap as the decode attention itself, never
O(L^2). Detach puts every original back exactly (a function the program registered meanwhile is left alone).

At the end of a step `take()` maps each layer's slots to token-buffer positions, reduces on the device (the
head-mean row per layer, its top weights, the selected layer's per-head and per-KV-group rows, the share of
each region kvtui knows) and moves everything to the host in ONE transfer.

Not covered: the paged attention of continuous batching (a packed forward holds several requests in one
block table; its steps carry no attention).
"""

from __future__ import annotations

import operator
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import compress

import torch

from ..records.snapshot import AttentionDetail, BufferToken, TokenBuffer
from .attention_regions import RegionIndex
from .attention_regions import shares as region_shares
from .introspect.transfer import HostReads

TOP = 100  # at most 100 positions can weigh >= 0.01: the top 100 hold every one of them
KEEP = 8  # at least the 8 largest are kept, whatever they weigh
FLOOR = 0.01  # and every position of at least this weight
RECENT = 16  # the "last W tokens" region
PAGED_NOTE = "paged attention (continuous batching) is not covered: a packed forward's steps carry no attention"


# ---- the registries ----------------------------------------------------------------------------------

_MODULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # attention module -> (capture, layer index)
_LOCK = threading.Lock()
_USERS = 0  # live captures: the mapping entries stay wrapped while any is
_WRAPPED: dict[
    tuple[int, str], tuple[object, Callable, Callable]
] = {}  # (id(owner), key) -> (owner, original, wrapper)
_EAGER_USERS: dict[str, int] = {}  # modeling module name -> captures using its eager_attention_forward


def _wrap(original: Callable) -> Callable:
    def attention(*args, **kwargs):
        result = original(*args, **kwargs)  # the model's own computation, untouched
        module = args[0] if args else kwargs.get("module")
        entry = _MODULES.get(module) if module is not None else None
        if entry is not None:
            capture, layer = entry
            capture.record(layer, args, kwargs)
        return result

    attention.__wrapped__ = original  # type: ignore[attr-defined]
    attention.__kvtui_attention__ = True  # type: ignore[attr-defined]
    return attention


def _patch(owner, key: str, get, set_) -> None:
    ident = (id(owner), key)
    if ident in _WRAPPED:
        return
    original = get()
    if not callable(original) or getattr(original, "__kvtui_attention__", False):
        return
    wrapper = _wrap(original)
    _WRAPPED[ident] = (owner, original, wrapper)
    set_(wrapper)


def _mapping_patches() -> None:
    """Wrap every entry of transformers' attention registry (the class-wide mapping and the global instance's)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    for mapping in (AttentionInterface._global_mapping, ALL_ATTENTION_FUNCTIONS._local_mapping):
        for key in list(mapping):
            _patch(mapping, key, lambda m=mapping, k=key: m[k], lambda value, m=mapping, k=key: m.__setitem__(k, value))


def _eager_patch(module_name: str) -> None:
    """A modeling module's `eager_attention_forward` (read from its globals at every call, 4.57 and 5.x)."""
    module = sys.modules.get(module_name)
    if module is None or not callable(getattr(module, "eager_attention_forward", None)):
        return
    _EAGER_USERS[module_name] = _EAGER_USERS.get(module_name, 0) + 1
    _patch(
        module,
        "eager_attention_forward",
        lambda: module.eager_attention_forward,
        lambda value: setattr(module, "eager_attention_forward", value),
    )


def _restore(only: Callable[[object], bool] = lambda owner: True) -> None:
    for ident, (owner, original, wrapper) in list(_WRAPPED.items()):
        if not only(owner):
            continue
        del _WRAPPED[ident]
        key = ident[1]
        if isinstance(owner, dict):
            if owner.get(key) is wrapper:  # the program registered its own meanwhile: leave it
                owner[key] = original
        elif getattr(owner, key, None) is wrapper:
            setattr(owner, key, original)


def _through_interface(module_name: str) -> bool:
    """Whether a modeling module calls transformers' attention interface (it imports the registry or defines the
    eager function kvtui wraps): Falcon's does neither, it calls torch's sdpa itself."""
    module = sys.modules.get(module_name)
    names = vars(module) if module is not None else {}
    return "ALL_ATTENTION_FUNCTIONS" in names or callable(names.get("eager_attention_forward"))


def patched() -> bool:
    """Whether any attention function is wrapped (for the transparency tests)."""
    return bool(_WRAPPED)


# ---- one model's capture -----------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionStep:
    """What take() returns: the snapshot's `attention` and its detail."""

    layers: tuple[tuple[tuple[int, float], ...] | None, ...]
    detail: AttentionDetail
    pads: tuple[int, ...] = ()  # buffer positions of the pads (region "pad")


class AttentionCapture:
    """The newest query's attention in every layer of one model, captured while attached.

    `head_layer` (a plain int the UI may set from its thread) picks the layer whose per-head rows are kept
    (-1: the last layer with attention). Rows are of batch row 0."""

    def __init__(self, model, head_layer: int = -1):
        global _USERS
        config = getattr(model, "config", None)
        text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
        self.num_layers = int(getattr(text, "num_hidden_layers", 0) or 0)
        self.head_layer = head_layer
        self.errors: list[str] = []
        self.memory: dict[str, dict] = {}  # per cache: what the attention alarms last said (check_attention)
        self._rows: dict[int, Scores] = {}  # layer -> its newest query's scores (this forward)
        self._regions = RegionIndex()
        self._modules: list[weakref.ref] = []
        self._eager: list[str] = []
        with _LOCK:
            for module in model.modules():
                index = getattr(module, "layer_idx", None)
                if isinstance(index, int) and module is not model:
                    _MODULES[module] = (self, index)
                    self._modules.append(weakref.ref(module))
                    self.num_layers = max(self.num_layers, index + 1)
                    name = type(module).__module__
                    if name not in self._eager:
                        self._eager.append(name)
                        _eager_patch(name)
            _USERS += 1
            _mapping_patches()
        self._attached = True

    def detach(self) -> None:
        global _USERS
        with _LOCK:
            if not self._attached:
                return
            self._attached = False
            for ref in self._modules:
                module = ref()
                if module is not None and _MODULES.get(module, (None,))[0] is self:
                    del _MODULES[module]
            for name in self._eager:
                _EAGER_USERS[name] = _EAGER_USERS.get(name, 1) - 1
                if _EAGER_USERS[name] <= 0:
                    del _EAGER_USERS[name]
                    module = sys.modules.get(name)
                    _restore(partial(operator.is_, module))
            _USERS -= 1
            if _USERS <= 0:
                _USERS = 0
                _restore()
            self._rows.clear()

    def clear(self) -> None:
        """Forget the rows of a forward whose step is not built (an error, a packed forward)."""
        self._rows.clear()

    def shares_outside(self, kept: Sequence[Sequence[set[int]] | None]) -> tuple[float | None, ...]:
        """After a forward over a whole sequence (verify's recompute: slot = position): per layer, the share of
        the newest query's attention, averaged over query heads, on the positions that layer's KV heads no
        longer hold (`kept[layer][kv_head]`: the positions held; None: not compressed, nothing to say). What a
        press threw away that the model would have looked at. The rows are taken (forgotten); one transfer."""
        rows, shares, where = dict(self._rows), [], []
        self._rows.clear()
        for layer, held in enumerate(kept):
            scores = rows.get(layer)
            if scores is None or held is None or len(held) != scores.kv_heads:
                continue
            probs = _softmax([scores])[0]  # [heads, n]
            keep = torch.zeros(scores.kv_heads, probs.shape[-1], dtype=torch.bool)  # [kv_heads, n]
            for head, positions in enumerate(held):
                keep[head, [p for p in positions if p < probs.shape[-1]]] = True
            group = probs.shape[0] // scores.kv_heads
            keep = keep.repeat_interleave(group, 0).to(probs.device)  # [heads, n]: each query head's KV head
            shares.append(probs.masked_fill(keep, 0.0).sum(-1).mean())
            where.append(layer)
        found = torch.stack(shares).tolist() if shares else []
        out: list[float | None] = [None] * len(kept)
        for layer, share in zip(where, found, strict=True):
            out[layer] = share
        return tuple(out)

    def off_reason(self) -> str:
        """Why the forward just taken carries no attention (`take`/`stage` gave None), in one line: kvtui captures
        the calls that go through transformers' attention interface, and this forward made none it could read."""
        if self.errors:
            return f"attention off: the capture failed ({self.errors[-1]})"
        modules = [module for module in (ref() for ref in self._modules) if module is not None]
        if not modules:
            return "attention off: no attention module found (none has a layer_idx): nothing to capture"
        kind = type(modules[0]).__name__
        if not any(_through_interface(name) for name in self._eager):
            return f"attention off: {kind} bypasses transformers' attention interface"
        return f"attention off: no call of this forward's {kind} layers went through transformers' attention interface"

    # ---- during the forward: called by the wrapper, in the program's thread -------------------------

    def record(self, layer: int, args: tuple, kwargs: dict) -> None:
        try:
            query = args[1] if len(args) > 1 else kwargs["query"]
            key = args[2] if len(args) > 2 else kwargs["key"]
            mask = args[4] if len(args) > 4 else kwargs.get("attention_mask")
            with torch.no_grad():
                scores = newest_scores(
                    query, key, mask, kwargs.get("scaling"), kwargs.get("softcap"), kwargs.get("s_aux"), args[0]
                )
            if scores is not None:
                self._rows[layer] = scores
        except Exception as exc:  # noqa: BLE001  never break the program's forward
            if len(self.errors) < 8:
                self.errors.append(f"layer {layer}: {type(exc).__name__}: {exc}")

    # ---- at the end of the step: one transfer -------------------------------------------------------

    def take(
        self,
        buffer: Sequence[BufferToken],
        turn: int,
        pad_id: int | None = None,
        pad_distinct: bool = False,
        window: int = RECENT,
    ) -> AttentionStep | None:
        """This forward's rows in buffer positions, reduced on the device, moved to the host once. Pads: tokens
        of origin pad/primed, and the pad id where it is distinct from the end ids or repeats (a run)."""
        reads = HostReads()
        staged = self.stage(reads, buffer, len(buffer), pad_id, pad_distinct, window)
        if staged is None:
            return None
        return self.finish(staged, buffer, turn, pad_id, pad_distinct, window)

    def stage(
        self,
        reads: HostReads,
        known: Sequence[BufferToken],
        total: int,
        pad_id: int | None = None,
        pad_distinct: bool = False,
        window: int = RECENT,
    ) -> _Staged | None:
        """Reduce this forward's rows on the device for a buffer of `total` positions whose first `len(known)`
        tokens are `known` (a watched step's new tokens are among the values the step's transfer brings back),
        and register what the snapshot needs in `reads`, the step's one transfer. `finish` reads it back."""
        rows, self._rows = self._rows, {}
        if not rows or total == 0:
            return None
        order = sorted(rows)
        selected = self.head_layer if self.head_layer in rows else order[-1]
        device = rows[order[-1]].scores.device
        # [layers, positions]: each layer's head-mean row, its slots placed at their buffer positions; the
        # layers alike (same held length, scaling, mask form) get one softmax together (few ops per step)
        means = torch.zeros((len(order), total), dtype=torch.float32, device=device)
        groups: dict[tuple, list[int]] = {}
        for i, layer in enumerate(order):
            groups.setdefault(rows[layer].group, []).append(i)
        chosen: torch.Tensor | None = None
        for members in groups.values():
            entries = [rows[order[i]] for i in members]
            probs = _softmax(entries)  # [group, heads, held]
            start, used, offset = _slots(probs.shape[-1], total)
            index = torch.tensor(members, device=device) if len(members) < len(order) else slice(None)
            means[index, offset : offset + used] = probs[:, :, start : start + used].mean(dim=1)
            if order.index(selected) in members:
                chosen = probs[members.index(order.index(selected))]  # [heads, held]
        assert chosen is not None
        start, used, offset = _slots(chosen.shape[-1], total)
        heads = torch.zeros((chosen.shape[0], total), dtype=torch.float32, device=device)
        heads[:, offset : offset + used] = chosen[:, start : start + used]  # [heads, positions]
        kv = rows[selected].kv_heads
        kv_groups = heads.view(kv, heads.shape[0] // kv, total).mean(dim=1)  # [kv_heads, positions]
        every = means.mean(dim=0, keepdim=True)  # [1, positions]: all layers
        ranked = torch.cat([means, every, heads, kv_groups])  # [layers + 1 + heads + kv_heads, positions]
        values, indices = ranked.topk(min(TOP, total), dim=-1)  # [rows, k]
        # region shares (attention_regions.py: a partition of the positions): one index_add over the classes of
        # the known positions now (on the device); the new positions' columns and the recent window's read as they
        # are, added up on the host once the new tokens are known
        count = min(len(known), total)
        items = getattr(known, "_items", None)
        head = TokenBuffer(items, count) if items is not None else known if count == len(known) else known[:count]
        regions = self._regions
        regions.scan(head, pad_id, pad_distinct)
        sums = torch.zeros((len(order), regions.class_count()), dtype=torch.float32, device=device)
        sums.index_add_(1, regions.device_classes(count, device), means[:, :count])  # [layers, classes]
        # the columns read back as they are: from the window's first or the one before the new ones (a pad run the
        # new token makes), whichever is earlier
        tail_from = max(min(count - 1, total - window), 0)
        staged = _Staged(
            rows=rows,
            order=order,
            selected=selected,
            total=total,
            known=count,
            items=getattr(known, "_items", known),
            region_items=regions.items,
            heads=heads.shape[0],
            ranked=ranked.shape[0],
            classes=regions.classes[tail_from:count],
            tail_from=tail_from,
            values=reads.add(values),
            indices=reads.add(indices),
            sum_handle=reads.add(sums),
            tail=reads.add(means[:, tail_from:]),  # [layers, total - tail_from]
            reads=reads,
        )
        return staged

    def finish(
        self,
        staged: _Staged,
        buffer: Sequence[BufferToken],
        turn: int,
        pad_id: int | None = None,
        pad_distinct: bool = False,
        window: int = RECENT,
    ) -> AttentionStep:
        """The step's AttentionStep from its resolved transfer (`stage`), the buffer now complete."""
        reads = staged.reads
        order, total = staged.order, staged.total
        k = min(TOP, total)
        values, indices = reads.flat(staged.values), reads.flat(staged.indices)
        shares = self._shares(staged, buffer, turn, window, pad_id, pad_distinct)  # (names, [layers][regions]) | None
        if shares is None:  # the buffer is not the one staged (an edit cut it): reduce it again, one more read
            return self._again(staged, buffer, turn, pad_id, pad_distinct, window)
        names, share_rows = shares
        rows_count = staged.ranked
        tops = [_top(values[r * k : (r + 1) * k], indices[r * k : (r + 1) * k]) for r in range(rows_count)]
        count = max(self.num_layers, order[-1] + 1)
        per_layer: list[tuple[tuple[int, float], ...] | None] = [None] * count
        per_shares: list[tuple[float, ...] | None] = [None] * count
        for i, layer in enumerate(order):
            per_layer[layer], per_shares[layer] = tops[i], share_rows[i]
        h = staged.heads
        detail = AttentionDetail(
            layer=staged.selected,
            heads=tuple(tops[len(order) + 1 : len(order) + 1 + h]),
            groups=tuple(tops[len(order) + 1 + h :]),
            all_layers=tops[len(order)],
            regions=names,
            shares=tuple(per_shares),
        )
        return AttentionStep(tuple(per_layer), detail, tuple(self._regions.pads()))

    def _again(self, staged: _Staged, buffer, turn: int, pad_id, pad_distinct: bool, window: int) -> AttentionStep:
        """The staged rows reduced over `buffer` whole (its tokens all known), read in a transfer of their own."""
        self._rows = staged.rows
        again = self.stage(HostReads(), buffer, len(buffer), pad_id, pad_distinct, window)
        assert again is not None
        return self.finish(again, buffer, turn, pad_id, pad_distinct, window)

    def _shares(self, staged: _Staged, buffer, turn: int, window: int, pad_id, pad_distinct: bool):
        """(region names, per layer the share of each region) from the staged class sums and the columns read as
        they are; None when the buffer is not the one staged (then the caller reduces it again)."""
        if len(buffer) != staged.total or getattr(buffer, "_items", buffer) is not staged.items:
            return None
        regions = self._regions
        if regions.scanned != staged.known or regions.items is not staged.region_items or regions.pad_id != pad_id:
            return None  # the index started over (or will): the staged sums are of other positions
        regions.scan(buffer, pad_id, pad_distinct)
        reads = staged.reads
        return region_shares(
            regions,
            reads.rows(staged.sum_handle),
            staged.classes,
            reads.rows(staged.tail),
            staged.tail_from,
            staged.known,
            staged.total,
            window,
            turn,
        )


@dataclass
class _Staged:
    """A step's attention between `stage` and `finish`: the device work done, its values in the step's transfer."""

    rows: dict[int, Scores]  # layer -> scores (kept for a reduction again)
    order: list[int]  # the layers captured, ascending
    selected: int  # the layer whose heads are kept
    total: int  # buffer positions reduced over
    known: int  # positions whose tokens were known (scanned) at stage
    items: object  # the buffer's list at stage
    region_items: object  # what the region index had scanned
    heads: int
    ranked: int  # rows of the top-k
    classes: list[int]  # the region classes of the known positions from `tail_from`, as staged
    tail_from: int  # first position of the columns read as they are
    values: int  # handles in `reads`
    indices: int
    sum_handle: int  # [layers, classes]: the known positions' weight per region class
    tail: int
    reads: HostReads


def _slots(held: int, total: int) -> tuple[int, int, int]:
    """(first slot, slots used, first buffer position) of a layer's K/V against the `total` tokens of the buffer.

    A layer hands attention what it holds in order: a dynamic layer every token, a sliding one its newest ones
    (the last `held` positions); a static layer `held` >= total slots, slot j = position j (the tail unfilled)."""
    if held >= total:
        return 0, total, 0
    return 0, held, total - held


def _top(values: list[float], indices: list[float]) -> tuple[tuple[int, float], ...]:
    """(position, weight) by weight descending: at least the KEEP largest and every one >= FLOOR. The rows are
    long (every head's and layer's top): the first rank from KEEP on below FLOOR is found by C-level passes, no
    Python line per entry."""
    end = next(compress(range(KEEP, len(values)), map(FLOOR.__gt__, values[KEEP:])), len(values))  # w < FLOOR
    return tuple(zip(map(int, indices[:end]), values[:end]))


@dataclass(frozen=True)
class Scores:
    """One layer's newest-query logits, as the attention call saw them; softmaxed at take() with its alikes."""

    scores: torch.Tensor  # [heads, held], the model's dtype: q_last . k^T, not yet scaled
    mask: torch.Tensor | None  # [1|heads, held]: bool (True: attend) or additive float; None: every key
    scaling: float
    softcap: float | None
    sinks: torch.Tensor | None  # [heads]: learned sink logits (gpt-oss), in the softmax, dropped after
    kv_heads: int

    @property
    def group(self) -> tuple:
        """What layers must share to be softmaxed together."""
        mask = None if self.mask is None else (self.mask.dtype == torch.bool, self.mask.shape[0])
        return (tuple(self.scores.shape), self.scaling, self.softcap, mask, self.sinks is None, self.kv_heads)


def newest_scores(query, key, mask, scaling=None, softcap=None, sinks=None, module=None) -> Scores | None:
    """The newest query's logits of batch row 0, per query head, and its mask row.

    query [batch, heads, q, head_dim]; key [batch, kv_heads, held, head_dim] (the whole cache of the layer);
    mask: None (causal: sdpa's is_causal aligns the queries top-left, so the newest of q queries sees the first
    q keys; a static cache's prefill from empty, whose other slots are unfilled), a bool [batch, 1|heads, q,
    >=held] (True: attend), an additive float one, a 2-D [batch, held] padding mask (flash), or a flex BlockMask."""
    if not isinstance(query, torch.Tensor) or not isinstance(key, torch.Tensor) or query.dim() != 4 or key.dim() != 4:
        return None
    heads, queries, head_dim = query.shape[1], query.shape[2], query.shape[-1]
    kv_heads, held = key.shape[1], key.shape[2]
    if heads % kv_heads:
        return None
    if scaling is None:
        scaling = getattr(module, "scaling", None) or head_dim**-0.5
    group = heads // kv_heads
    # GQA: each KV head serves `group` query heads (no repeat of K): [kv_heads, group, d] @ [kv_heads, d, held]
    scores = torch.matmul(query[0, :, -1, :].view(kv_heads, group, head_dim), key[0].transpose(-1, -2))
    row: torch.Tensor | None = None
    if isinstance(mask, torch.Tensor):
        if mask.dim() == 4:
            row = mask[0, :, -1, :held]  # [1|heads, held]
        elif mask.dim() == 2:
            row = mask[0:1, -held:]
            row = row if row.dtype == torch.bool else row.bool()
        else:
            row = mask.reshape(-1, mask.shape[-1])[-1:, :held]
    elif mask is not None and hasattr(mask, "mask_mod"):  # flex attention's BlockMask
        row = _block_mask_row(mask, queries, held, scores.device)
    elif mask is None and 1 < queries < held and getattr(module, "is_causal", True):
        row = torch.arange(held, device=scores.device).view(1, held) < queries  # is_causal's top-left alignment
    return Scores(
        scores.reshape(heads, held),
        row,
        float(scaling),
        float(softcap) if softcap else None,
        sinks.reshape(heads) if isinstance(sinks, torch.Tensor) else None,
        kv_heads,
    )


def _softmax(entries: list[Scores]) -> torch.Tensor:
    """Alike layers' probabilities at once: [layers, heads, held] float32, as eager computes them."""
    first = entries[0]
    scores = torch.stack([e.scores for e in entries]).float() * first.scaling  # [layers, heads, held]
    if first.softcap:
        scores = torch.tanh(scores / first.softcap) * first.softcap
    if first.mask is not None:
        shape = scores.shape[1:]
        masks = torch.stack([e.mask.expand(shape) for e in entries if e.mask is not None])  # [layers, heads, held]
        if masks.dtype == torch.bool:
            scores = scores.masked_fill(~masks, float("-inf"))
        else:
            scores = scores + masks.float()
    if first.sinks is not None:  # learned sinks: one more logit per head in the softmax, dropped after
        sinks = torch.stack([e.sinks for e in entries if e.sinks is not None]).float().unsqueeze(-1)
        return torch.softmax(torch.cat([scores, sinks.to(scores.device)], dim=-1), dim=-1)[..., :-1]
    return torch.softmax(scores, dim=-1)


def newest_row(query, key, mask, scaling=None, softcap=None, sinks=None, module=None) -> torch.Tensor | None:
    """softmax(q_last k^T * scaling + mask_last) of batch row 0, per query head: [heads, held] float32."""
    scores = newest_scores(query, key, mask, scaling, softcap, sinks, module)
    return None if scores is None else _softmax([scores])[0]


def _block_mask_row(mask, queries: int, held: int, device) -> torch.Tensor:
    """The newest query's row of a flex BlockMask, from its mask_mod: [1, held] bool."""
    b = torch.zeros((), dtype=torch.long, device=device)
    q_index = torch.full((held,), int(mask.seq_lengths[0]) - 1 if hasattr(mask, "seq_lengths") else queries - 1)
    kv_index = torch.arange(held, device=device)
    return mask.mask_mod(b, b, q_index.to(device), kv_index).reshape(1, held).bool()


# ---- reading a snapshot's attention (the UI, the notebook, the rulebook) ------------------------------


def dense_row(entries: Sequence[tuple[int, float]] | None, total: int) -> list[float]:
    """A recorded row as one weight per buffer position (positions not recorded weigh < 0.01: shown as 0)."""
    row = [0.0] * total
    for position, weight in entries or ():
        if 0 <= position < total:
            row[position] = weight
    return row

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

import torch

from ..records.snapshot import AttentionDetail, BufferToken, TokenBuffer
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
        self._regions = _RegionIndex()
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
        # region shares: the sums over the known positions now (on the device), the new positions' columns read
        # as they are (a decode step's one column), added up on the host once their tokens are known
        count = min(len(known), total)
        sums = self._regions.known_sums(known, count, total, window, pad_id, pad_distinct, device)
        tail_from = max(count - 1, 0)  # the column before the new ones too: a pad run that the new token makes
        staged = _Staged(
            rows=rows,
            order=order,
            selected=selected,
            total=total,
            known=count,
            items=getattr(known, "_items", known),
            region_items=self._regions.items,
            means=means,
            heads=heads.shape[0],
            ranked=ranked.shape[0],
            sums={key[:3]: i for i, key in enumerate(sums)},
            tail_from=tail_from,
            values=reads.add(values),
            indices=reads.add(indices),
            sum_handle=reads.add(torch.stack([_sum(key, means) for key in sums], dim=-1)) if sums else None,
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
        shares = self._shares(staged, buffer, turn, window, pad_id, pad_distinct)  # [layers][regions] or None
        if shares is None:  # the buffer is not the one staged (an edit cut it): reduce it again, one more read
            names, columns = self._regions.columns(buffer, turn, window, pad_id, pad_distinct)
            means = staged.means
            if len(buffer) != total:
                self._rows = staged.rows
                again = self.stage(HostReads(), buffer, len(buffer), pad_id, pad_distinct, window)
                assert again is not None
                return self.finish(again, buffer, turn, pad_id, pad_distinct, window)
            flat = torch.stack([column(means) for column in columns], dim=-1).tolist()  # [layers, regions]
            shares = (names, [tuple(row) for row in flat])
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

    def _shares(self, staged: _Staged, buffer, turn: int, window: int, pad_id, pad_distinct):
        """(region names, per layer the share of each region) from the staged sums and the new columns; None
        when the buffer is not the one staged (then the caller reduces it again)."""
        if len(buffer) != staged.total or getattr(buffer, "_items", buffer) is not staged.items:
            return None
        regions = self._regions
        if regions.scanned != staged.known or regions.items is not staged.region_items:
            return None  # the index started over: the staged sums are of other positions
        names, spans = regions.spans(buffer, turn, window, pad_id, pad_distinct)
        reads, known, tail_from = staged.reads, staged.known, staged.tail_from
        sums = reads.rows(staged.sum_handle) if staged.sum_handle is not None else [[] for _ in staged.order]
        tail = reads.rows(staged.tail)  # [layers][total - tail_from]
        result: list[list[float]] = [[] for _ in staged.order]
        for key in spans:
            old, new = _split(key, known)
            if old is not None and old not in staged.sums:
                # the new token made a run of the pad id: the column before it (read with the new ones) joined the pads
                joined = old[0] == "sparse" and tail_from == known - 1 and key[2][old[2] - 1] == known - 1
                before = ("sparse", old[1], old[2] - 1) if old[2] > 1 else None
                if not joined or (before is not None and before not in staged.sums):
                    return None
                old, new = before, [known - 1, *new]
            for layer, row in enumerate(result):
                share = sums[layer][staged.sums[old]] if old is not None else 0.0
                for position in new:
                    share += tail[layer][position - tail_from]
                row.append(share)
        return names, [tuple(row) for row in result]


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
    means: torch.Tensor  # [layers, total] float32, on the device
    heads: int
    ranked: int  # rows of the top-k
    sums: dict[tuple, int]  # a region's part over the known positions -> its column in `sum_handle`
    tail_from: int  # first position of the columns read as they are
    values: int  # handles in `reads`
    indices: int
    sum_handle: int | None
    tail: int
    reads: HostReads


def _sum(key: tuple, means: torch.Tensor) -> torch.Tensor:
    """A staged region part of `means` [layers, positions]: [layers]."""
    if key[0] == "span":
        return means[:, key[1] : key[2]].sum(-1)
    return means.index_select(1, key[3]).sum(-1)


def _split(key: tuple, known: int) -> tuple[tuple | None, list[int]]:
    """A region (`_RegionIndex.spans`) as its part over the first `known` positions (a staged key, None: empty)
    and its positions from `known` on."""
    if key[0] == "span":
        first, end = key[1], key[2]
        old = ("span", first, min(end, known)) if first < min(end, known) else None
        return old, list(range(max(first, known), end))
    positions = key[2]
    count = sum(1 for p in positions if p < known)
    return (("sparse", key[1], count) if count else None), [p for p in positions if p >= known]


def _slots(held: int, total: int) -> tuple[int, int, int]:
    """(first slot, slots used, first buffer position) of a layer's K/V against the `total` tokens of the buffer.

    A layer hands attention what it holds in order: a dynamic layer every token, a sliding one its newest ones
    (the last `held` positions); a static layer `held` >= total slots, slot j = position j (the tail unfilled)."""
    if held >= total:
        return 0, total, 0
    return 0, held, total - held


def _top(values: list[float], indices: list[float]) -> tuple[tuple[int, float], ...]:
    """(position, weight) by weight descending: at least the KEEP largest and every one >= FLOOR."""
    kept = []
    for rank, (weight, index) in enumerate(zip(values, indices)):
        if rank >= KEEP and weight < FLOOR:
            break
        kept.append((int(index), weight))
    return tuple(kept)


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


def _span_share(first: int, end: int, means: torch.Tensor) -> torch.Tensor:
    return means[:, first:end].sum(-1)  # [layers, positions] -> [layers]


class _RegionIndex:
    """Positions of the regions kvtui knows, kept up to date as the (append-only) buffer grows."""

    def __init__(self):
        self._items: object = None
        self._scanned = 0
        self._pad_id: int | None = None
        self._user_seen = False  # template tokens before the first user token are the system prompt
        self._sparse: dict[str, list[int]] = {}
        self._turns: dict[int, list[int]] = {}  # turn -> [first, last + 1]
        self._device_cache: dict[str, tuple[int, torch.Tensor]] = {}

    def pads(self) -> list[int]:
        return self._sparse.get("pad", [])

    @property
    def items(self) -> object:
        return self._items

    @property
    def scanned(self) -> int:
        return self._scanned

    def known_sums(self, known, count: int, total: int, window: int, pad_id, distinct: bool, device) -> list[tuple]:
        """Scan the first `count` tokens of `known`; the keys of the region parts over them that `spans` can ask
        for once the buffer holds `total` (sparse keys carry their index tensor for the device)."""
        items = getattr(known, "_items", None)
        head = TokenBuffer(items, count) if items is not None else known if count == len(known) else known[:count]
        self._scan(head, pad_id, distinct)
        keys: list[tuple] = []
        if count:
            keys.append(("span", 0, 1))  # the sink
        for name, positions in self._sparse.items():
            if positions:
                keys.append(("sparse", name, len(positions), self._index(name, positions, device)))
        for number in sorted(self._turns):
            first, end = self._turns[number]
            keys.append(("span", first, end))
        if self._turns:  # the newest turn may go on with the new tokens
            first, end = self._turns[max(self._turns)]
            if end < count:
                keys.append(("span", first, count))
        recent = total - min(window, total)
        if recent < count:
            keys.append(("span", recent, count))
        seen: dict[tuple, tuple] = {}
        for key in keys:
            seen.setdefault(key[:3], key)
        return list(seen.values())

    def spans(self, buffer, turn: int, window: int, pad_id, distinct: bool) -> tuple[tuple[str, ...], list[tuple]]:
        """(names, regions) of every region present, as ("span", first, end) or ("sparse", name, positions)."""
        self._scan(buffer, pad_id, distinct)
        total = len(buffer)
        names: list[str] = ["sink"]
        keys: list[tuple] = [("span", 0, 1)]
        for name in ("system", "special", "pad", "unknown"):
            positions = self._sparse[name]
            if positions:
                names.append(name)
                keys.append(("sparse", name, positions))
        for number in sorted(self._turns):
            first, end = self._turns[number]
            names.append("this turn" if number == turn else f"turn {number}")
            keys.append(("span", first, end))
        recent = min(window, total)
        names.append(f"last {recent}")
        keys.append(("span", total - recent, total))
        return tuple(names), keys

    def _scan(self, buffer: Sequence[BufferToken], pad_id: int | None, pad_distinct: bool) -> None:
        items = getattr(buffer, "_items", None)
        if items is None or items is not self._items or len(buffer) < self._scanned or pad_id != self._pad_id:
            self._items, self._scanned, self._pad_id = items, 0, pad_id
            self._sparse = {"special": [], "pad": [], "system": [], "unknown": []}
            self._turns = {}
            self._device_cache = {}
            self._user_seen = False
        pads = self._sparse["pad"]
        for position in range(self._scanned, len(buffer)):
            token = buffer[position]
            if token.special and token.origin not in ("pad", "primed"):
                self._sparse["special"].append(position)
            if token.origin == "user":
                self._user_seen = True
            system = token.origin == "system" or (token.origin == "template" and not self._user_seen)
            if token.origin in ("system", "unknown"):
                self._sparse[token.origin].append(position)
            elif system:  # the template's own system prompt
                self._sparse["system"].append(position)
            if token.origin in ("pad", "primed") or (token.id == pad_id and pad_distinct):
                pads.append(position)
            elif token.id == pad_id and pad_id is not None and position and buffer[position - 1].id == pad_id:
                if not pads or pads[-1] != position - 1:  # a run of the pad id (a pad that doubles as EOS)
                    pads.append(position - 1)
                pads.append(position)
            if not system:  # a turn's share is its own tokens': the system prompt is a region of its own
                span = self._turns.setdefault(token.turn, [position, position + 1])
                span[1] = position + 1
        self._scanned = len(buffer)

    def columns(self, buffer: Sequence[BufferToken], turn: int, window: int, pad_id: int | None, distinct: bool):
        """(names, functions means [layers, positions] -> share [layers]) of every region present."""
        self._scan(buffer, pad_id, distinct)
        total = len(buffer)
        names: list[str] = ["sink"]
        columns: list[Callable[[torch.Tensor], torch.Tensor]] = [partial(_span_share, 0, 1)]
        for name in ("system", "special", "pad", "unknown"):
            positions = self._sparse[name]
            if positions:
                names.append(name)
                columns.append(partial(self._sparse_share, name, positions))
        for number in sorted(self._turns):
            first, end = self._turns[number]
            names.append("this turn" if number == turn else f"turn {number}")
            columns.append(partial(_span_share, first, end))
        recent = min(window, total)
        names.append(f"last {recent}")
        columns.append(partial(_span_share, total - recent, total))
        return tuple(names), columns

    def _sparse_share(self, name: str, positions: list[int], means: torch.Tensor) -> torch.Tensor:
        return means.index_select(1, self._index(name, positions, means.device)).sum(-1)  # [layers]

    def _index(self, name: str, positions: list[int], device) -> torch.Tensor:
        cached = self._device_cache.get(name)
        if cached is None or cached[0] != len(positions):
            cached = (len(positions), torch.tensor(positions, dtype=torch.long, device=device))
            self._device_cache[name] = cached
        return cached[1]


# ---- reading a snapshot's attention (the UI, the notebook, the rulebook) ------------------------------


def dense_row(entries: Sequence[tuple[int, float]] | None, total: int) -> list[float]:
    """A recorded row as one weight per buffer position (positions not recorded weigh < 0.01: shown as 0)."""
    row = [0.0] * total
    for position, weight in entries or ():
        if 0 <= position < total:
            row[position] = weight
    return row

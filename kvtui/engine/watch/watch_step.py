"""One watched forward -> one StepSnapshot: what was fed (per batch row, pads marked), the positions
the model applied, the cache's rows and layers, top-k, and the alarms the rulebook (`diagnostics.py`)
raises on them. Pure bookkeeping over what the probe read; it never calls the model.

Shapes: input_ids / position_ids [batch, n]; attention_mask [batch, cached + n] (2-D), or the 4-D mask
[batch, heads, n, slots] generate() builds for a static cache (a dict of them per layer type: the full layers'
is read); logits [batch, n or 1, vocab].
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter
from typing import Any

import torch

from ..reading import introspect
from ..reading.alarms import Alarms
from ..reading.diagnostics import (
    SpecialIds,
    check_attention,
    check_drift,
    check_feed,
    check_request,
    feed_is_plain,
    recomputed_prefix,
    request_unasked,
)
from ..reading.token_texts import TokenTexts, tokenizer_texts
from ..reading.tokens import special_token_ids
from ..reading.topk import top_row_from, top_rows_from, top_tensors, watched_tokens
from ..records.snapshot import (
    BufferToken,
    Diagnostic,
    RowView,
    StepSnapshot,
    TokenBuffer,
    TopToken,
    fast_init,
    from_columns,
)
from . import evictions
from .lineage import CacheTrack
from .patches import Registry
from .step_checks import check_positions, checked_layers

_CODE = attrgetter("code")  # of a Diagnostic
_SHAPING_ARGUMENTS = frozenset(("attention_mask", "cache_position", "position_ids"))  # of a forward
_SHAPING_READS = frozenset(("mask_new", "real_before", "cache_position", "position_ids"))  # a Call's handles


@fast_init  # made on every forward: its ~35 fields filled in one call, not one line each
@dataclass
class Call:
    """One top-level forward in flight (between the probe's before and after)."""

    probe: Any  # the probe of the model called (a hooks.Probe: hooks imports this module, not the reverse)
    caller: str
    thread: str | None  # the thread's name, off the main thread
    n: int
    batch: int
    cache: object | None
    cache_length_before: int
    # the call's values, filled from its transfer (`take_reads`): None until then, or when not passed
    input_ids: list[list[int]] | None = None  # [batch][n]; None when only inputs_embeds were passed
    mask_new: list[list[int]] | None = None  # [batch][n] attention mask of the fed tokens
    real_before: list[int] | None = None  # [batch] attended tokens already cached (None: no 2-D mask)
    requested_positions: list[list[int]] | None = None
    requested_cache_position: list[int] | None = None
    use_cache: bool | None = None  # as passed (None: not passed, the model's config decides)
    track: CacheTrack | None = None  # the cache's
    found: list[Diagnostic] = field(default_factory=list)
    applied: torch.Tensor | None = None  # position ids read at the rotary / position embedding
    positions_source: str = "derived"
    started: float = 0.0  # perf_counter when the forward began (after any pause)
    mask_length: int | None = None  # columns of a 2-D attention mask (None: none passed)
    # a continuous-batching forward (packed_step.py): its reading, its run's lanes, the rows its logits are at
    packed: Any = None  # serving.packed.PackedForward
    packed_run: Any = None  # packed_step.PackedRun
    logits_indices: Sequence[int] = ()  # (a packed forward's: set by packed_step)
    # the step's one transfer (read_call registers the call's tensors, the step its positions and top-k; the
    # alarms that need their values run once it is resolved) and the handles of what it reads
    reads: introspect.HostReads | None = None
    handles: dict[str, int] = field(default_factory=dict)
    generating: Sequence = ()  # generate() frames between the caller and the forward (begin_forward sets them)
    pending_edit: introspect.PendingEdit | None = None  # the cache's in-place edit check, waiting for the transfer
    edits_at: int = 0  # where in `found` that alarm goes (what was said before it stays before it)
    mask_cached: torch.Tensor | None = None  # [batch, cached] columns of a 2-D mask, until `count_attended`
    # a mask was passed whose columns are not the cache's slots (a sliding window's 4-D mask): its pads are the
    # cache's running count (`count_attended`) when it has one; else they cannot be told (`pads_unknown`)
    mask_unread: bool = False
    pads_unknown: bool = False
    attention: Any = None  # the step's attention reduced on the device, its values in `reads` (AttentionCapture.stage)
    last_logits: torch.Tensor | None = None  # [1, vocab] float32 copy of the last position's logits (`prepare`)
    capturing: bool = False  # what its layers write is kept (evictions.begin): it may compress the cache
    expected_start: int | None = None  # a compressed cache: the position its kept keys continue (else its length)
    masks_staged: list | None = None  # layers whose masked keys changed: (index, indices or None, handles) (masks.py)

    def take_reads(self) -> None:
        """Fill the call's values from its resolved transfer (what `read_call` left as handles)."""
        if self.reads is None:
            return
        handles, reads = self.handles, self.reads
        if "input_ids" in handles:
            h = handles["input_ids"]
            self.input_ids = [reads.flat(h)] if self.batch == 1 else reads.rows(h)  # [batch][n]
        if not _SHAPING_READS.isdisjoint(handles):  # what a mask, cache_position or position_ids passed holds
            if "mask_new" in handles:
                self.mask_new = reads.rows(handles["mask_new"])  # [batch][n]
            if "real_before" in handles:
                self.real_before = reads.flat(handles["real_before"])  # [batch]
            elif self.mask_new is not None and self.real_before is None:
                self.real_before = [self.cache_length_before] * self.batch
            if "cache_position" in handles:
                self.requested_cache_position = reads.flat(handles["cache_position"])
            if "position_ids" in handles:
                rows = reads.rows(handles["position_ids"])
                self.requested_positions = rows if len(rows) == self.batch else [rows[0]] * self.batch
        track = self.track  # the count the next forward's mask continues from (`count_attended`): kept or forgotten
        if track is not None and (self.mask_new is not None or track.attended is not None):
            track.attended = None
            if self.mask_new is not None and self.real_before is not None and self.mask_length is not None:
                attended = [before + sum(row) for before, row in zip(self.real_before, self.mask_new)]
                track.attended = ((self.mask_length, self.cache_length_before + self.n), attended)

    def count_attended(self) -> None:
        """The attended tokens already cached, per row, from a 2-D mask's cached columns: the cache's running count
        when this mask continues the one its last forward had (as many cached columns as that mask had columns,
        the cache as long as that forward left it: generate() and every loop extend their mask by the fed
        tokens), so a step reads only its new columns; else one reduction of the cached columns, in the step's
        transfer. (A program that rewrites earlier columns of a mask it keeps extending is counted as it was.)"""
        cached, self.mask_cached = self.mask_cached, None
        if self.mask_unread:  # the count the cache's last forward left, the fed tokens real (generate's steps)
            kept = self.track.attended if self.track is not None else None
            if kept is not None and kept[0] == (self.cache_length_before, self.cache_length_before):
                self.real_before, self.mask_new = list(kept[1]), [[1] * self.n] * self.batch
            else:
                self.pads_unknown = True
            return
        if cached is None or self.reads is None:
            return
        kept = self.track.attended if self.track is not None else None
        if kept is not None and kept[0] == (cached.shape[-1], self.cache_length_before) and len(kept[1]) == self.batch:
            self.real_before = list(kept[1])
        else:
            self.handles["real_before"] = self.reads.add(cached.sum(-1))  # [batch]: one reduction


def read_call(probe, args, kwargs, caller: str, thread: str | None) -> Call:
    """What a forward was called with: shapes now (metadata), values registered in the step's one transfer
    (`Call.take_reads` fills them once it is resolved)."""
    # what bind_partial would give, at a tenth of its cost (only read: a call by keywords reads its own dict)
    values = {**dict(zip(probe.positional, args)), **kwargs} if args else kwargs
    reads = introspect.HostReads()
    handles: dict[str, int] = {}
    input_ids = values.get("input_ids")
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids if input_ids.dim() == 2 else input_ids.reshape(1, -1)  # [batch, n]
        batch, n = ids.shape
        handles["input_ids"] = reads.add(ids)
    elif isinstance(embeds := values.get("inputs_embeds"), torch.Tensor):
        batch, n = embeds.shape[0], embeds.shape[1]
    else:
        batch, n = 1, 0
    cache = introspect.cache_in(values)
    cache_len = introspect.seq_length(cache) if cache is not None else 0
    call = Call(
        probe=probe,
        caller=caller,
        thread=thread,
        n=n,
        batch=batch,
        cache=cache,
        cache_length_before=cache_len,
        use_cache=values.get("use_cache"),
        reads=reads,
        handles=handles,
    )
    if not _SHAPING_ARGUMENTS.isdisjoint(values):  # a mask, cache_position or position_ids (a plain loop: none)
        _read_shaping(call, values, reads, handles)
    return call


def _read_shaping(call: Call, values: dict, reads: introspect.HostReads, handles: dict[str, int]) -> None:
    """A forward's attention mask, cache_position and position_ids: their values registered in its transfer,
    the mask's length and cached columns kept on the call."""
    n, batch, cache_len = call.n, call.batch, call.cache_length_before
    mask_cached = None
    mask = values.get("attention_mask")
    mask_unread = mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2)
    if mask_unread:  # a 4-D mask (a dict of them per layer type): read as the 2-D mask it was built from
        mask = _as_2d(mask, cache_len, n)
        mask_unread = mask is None
    mask_length = mask.shape[-1] if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[-1] >= n:
        if mask.shape[0] == 1 < batch:  # one mask for every row (broadcast): each row's own
            mask = mask.expand(batch, -1)
        handles["mask_new"] = reads.add(mask[:, mask.shape[-1] - n :])  # [batch, n]
        if mask.shape[-1] > n:
            mask_cached = mask[:, : mask.shape[-1] - n]  # [batch, cached]: counted by `count_attended`
    elif mask_unread:
        mask_length = cache_len + n  # as long as a 2-D mask of this forward would be
    cache_position = values.get("cache_position")
    if isinstance(cache_position, torch.Tensor):
        handles["cache_position"] = reads.add(cache_position.reshape(-1))
    position_ids = values.get("position_ids")
    if isinstance(position_ids, torch.Tensor):
        if position_ids.dim() == 3:  # multimodal RoPE [3, batch, n]
            position_ids = position_ids[0]
        handles["position_ids"] = reads.add(
            position_ids if position_ids.dim() == 2 else position_ids.reshape(-1, position_ids.shape[-1])
        )
    call.mask_length, call.mask_cached, call.mask_unread = mask_length, mask_cached, mask_unread


def _as_2d(mask, cached: int, n: int) -> torch.Tensor | None:
    """A 4-D mask [batch, heads, n, slots] (what generate() passes a model with a static cache; bool, or additive
    with 0 where attended; a dict of them per layer type, whose full layers' is read) as the 2-D mask
    [batch, cached + n] it was built from: the cached slots the newest token attends, then whether each fed token
    attends its own slot (a pad attends nothing). None when its columns are not the cache's slots (a sliding
    window's, fewer) or it is another form."""
    if isinstance(mask, dict):
        mask = mask.get("full_attention")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-2] != n or mask.shape[-1] < cached + n:
        return None
    if n == 0:
        return None
    rows = mask[:, 0]  # [batch, n, slots]
    attends = rows if rows.dtype == torch.bool else rows == 0 if rows.is_floating_point() else rows != 0
    own = attends[:, :, cached : cached + n].diagonal(dim1=-2, dim2=-1)  # [batch, n]
    return torch.cat([attends[:, -1, :cached], own], dim=-1) if cached else own  # [batch, cached + n]


def _fed_tokens(
    n: int, positions: list[int], ids: list[int], pieces: list[str], special, turn: int, mask: list[int], added
) -> list[BufferToken]:
    """A row's `n` fed tokens, pads and tokenizer-added ids marked (`added`: their indices). Every token fed, as
    many positions as tokens (most forwards): made field by field in C-level passes, no Python line per token."""
    if len(positions) >= n and not added and all(mask):
        columns = (positions, ids, pieces, map(special.__contains__, ids), repeat("fed"), repeat(turn))
        return from_columns(BufferToken, n, columns)
    return [
        BufferToken(
            position=positions[i],
            id=ids[i],
            piece=pieces[i],
            special=ids[i] in special,
            turn=turn,
            origin="pad" if not mask[i] else "tokenizer-added" if i in added else "fed",
        )
        for i in range(n)
    ]


@functools.lru_cache(maxsize=64)  # a program of many call sites or caches: the newest kept
def _site_fields(
    phase, caller, cache_id, capacity, model, thread, positions_source, batch, texts: TokenTexts
) -> dict[str, Any]:
    """StepBuilder._site's fields for one set of values (shared by the steps: only passed on with `**`)."""
    return dict(
        phase=phase,
        capacity=capacity,
        chosen=None,
        chosen_forced=False,
        source="watch",
        caller=caller,
        cache_id=cache_id,
        positions_source=positions_source,
        batch=batch,
        model=model,
        thread=thread,
        token_bytes=texts.token_bytes,
    )


_TOP_HANDLES = ("top_values", "top_logprobs", "top_ids")  # the handles of the top-k's reads, in that order


class StepBuilder:
    """Builds a watcher's snapshots; keeps what it needs across steps (pieces, specials, encodings)."""

    def __init__(self, watcher):
        self.watcher = watcher
        self.probe: Any = None  # the model whose forward is read now: its tokenizer decodes the pieces
        self._tok: Any = None
        self._refs: tuple = ()  # (the probe's own tokenizer's weak reference, the watcher's tokenizer) last read
        self._texts = tokenizer_texts(None)  # the token texts of the tokenizer in use (one per tokenizer)
        self._by_tokenizer: Registry[TokenTexts] = Registry()
        self._specials: tuple[SpecialIds, frozenset[int]] | None = None  # of the model and tokenizer in use
        self._encodings: list[tuple[tuple[int, ...], frozenset[int]]] = []  # recent tokenizer outputs
        self._adding: list[tuple[tuple[int, ...], frozenset[int]]] = []  # those of them that added tokens
        self._no_cache_alarms = Alarms()  # forwards with no cache share one repeat state

    # ---- tokens ----------------------------------------------------------------------------------

    def use(self, probe) -> None:
        """Read the next tokens with this model's tokenizer (a program that runs two model families has
        two vocabularies: an id is a different piece in each)."""
        refs = (probe.tokenizer_ref, self.watcher.tokenizer)
        if probe is self.probe and refs == self._refs:  # the same model, both tokenizers named as last time
            return  # (the one in use is held here: what a weak reference names cannot change while it is)
        self.probe, self._refs, self._specials = probe, refs, None
        tok = self.watcher.tokenizer_of(probe)
        if tok is self._tok and self._tok is not None:
            return
        self._tok = tok
        if tok is None:
            self._texts = tokenizer_texts(None)
            return
        held = self._by_tokenizer.get(tok)
        if held is None:
            held = tokenizer_texts(tok)
            try:
                self._by_tokenizer.add(tok, held)
            except TypeError:  # an object without weak references: its pieces last while it is in use
                pass
        self._texts = held

    def piece(self, token_id: int) -> str:
        return self._texts.piece(token_id)

    @property
    def token_bytes(self) -> dict[int, bytes]:
        """The bytes of the pieces that are not their token's bytes (records/token_bytes.py), of this tokenizer."""
        return self._texts.token_bytes

    def label(self, token_id: int) -> str:
        """`'piece' (id N)`, escaped, a partial UTF-8 piece shown as its raw token."""
        return self._texts.label(token_id)

    def specials(self) -> tuple[SpecialIds, frozenset[int]]:
        if self._specials is None:  # read once per model and tokenizer (`use` forgets them when either changes)
            self._specials = self._read_specials(self._tok, self.probe)  # the sets cost more than a step's bookkeeping
        return self._specials

    def _read_specials(self, tok, probe) -> tuple[SpecialIds, frozenset[int]]:
        if tok is None:
            return SpecialIds(None, frozenset(), None), frozenset()
        eos = {tok.eos_token_id} if isinstance(tok.eos_token_id, int) else set()
        for other in self.watcher.probes:  # this model's end ids (and those of models sharing its tokenizer)
            if other is not probe and self.watcher.tokenizer_of(other) is not tok:
                continue
            gen = getattr(other.model, "generation_config", None)
            value = getattr(gen, "eos_token_id", None)
            eos.update([value] if isinstance(value, int) else (value or []))
        return SpecialIds(tok.bos_token_id, frozenset(eos), tok.pad_token_id), special_token_ids(tok)

    def saw_encoding(self, ids: list[int], added: set[int]) -> None:
        self._encodings.append((tuple(ids), frozenset(added)))
        del self._encodings[:-16]
        self._adding = [(encoding, added) for encoding, added in self._encodings if added]

    def _tokenizer_added(self, call: Call) -> set[int]:
        """Indices of fed tokens (row 0) that a seen tokenizer call added (BOS/EOS the text did not contain)."""
        if call.input_ids is None or not self._adding:
            return set()
        ids = tuple(call.input_ids[0])
        for encoding, added in reversed(self._adding):
            if len(encoding) >= len(ids) and encoding[len(encoding) - len(ids) :] == ids:
                offset = len(encoding) - len(ids)
                return {i - offset for i in added if i >= offset}
        return set()

    # ---- caches ----------------------------------------------------------------------------------

    def check_request(self, call: Call) -> None:
        track = call.track  # the repeat state of the cache the forward uses (each cache its own)
        alarms, capacity = (track.alarms, track.capacity) if track is not None else (self._no_cache_alarms, None)
        if request_unasked(alarms, call.requested_cache_position, capacity):
            return
        call.found += check_request(
            alarms,
            self.watcher.steps + 1,
            cache_position=call.requested_cache_position,
            accepts_cache_position=call.probe.accepts_cache_position,
            cache_len=call.cache_length_before if call.expected_start is None else call.expected_start,
            n=call.n,
            capacity=capacity,
            at=f" [{call.caller}]",
        )

    # ---- the step ----------------------------------------------------------------------------------

    def prepare(self, call: Call, logits) -> None:
        """Register what the step reads after the forward (the positions the model applied, the top-k of the
        last position) in the call's transfer, beside its inputs: nothing is read yet."""
        reads = call.reads
        if reads is None:
            return
        if call.applied is not None:
            positions = call.applied
            # [batch, n] as most models pass them; else made so (the rows past the call's batch are never read)
            if positions.dim() != 2 or positions.shape[-1] != call.n or positions.shape[0] > call.batch:
                if positions.dim() == 3:  # multimodal RoPE: [3, batch, n], the text axis first
                    positions = positions[0]
                positions = positions.reshape(-1, positions.shape[-1])[: call.batch]  # [batch or 1, m]
                positions = positions[:, -call.n :] if call.n else positions
            call.handles["applied"] = reads.add(positions)
        if logits is not None and logits.dim() == 3:
            scores = logits[: call.batch, -1]  # [batch, vocab] (rows past the call's batch are never read)
            if scores.dtype != torch.float32:  # converted once: a copy, not the program's tensor
                scores = scores.float()
                if scores.shape[0] == 1:  # verify keeps it (of a batch, only row 0: copied after the forward)
                    call.last_logits = scores.detach()
            values, logprobs, ids = top_tensors(scores, self.watcher.top_k)  # [batch, k] each
            call.handles.update(top_values=reads.add(values), top_logprobs=reads.add(logprobs), top_ids=reads.add(ids))
        capture = call.probe.attention
        if capture is None:
            return
        if call.expected_start is not None:
            capture.clear()  # a compressed cache: its key slots are not the buffer's positions (not mapped yet)
        else:  # the newest query's attention over the row the fed tokens extend
            rows = call.track.rows if call.track is not None else []
            known = TokenBuffer(rows[0]) if rows else TokenBuffer([])
            specials = self.specials()[0]
            call.attention = capture.stage(reads, known, len(known) + call.n, specials.pad, specials.pad_is_distinct)

    def build(
        self, call: Call, step: int, cache, track, logits, forward_ms: float, snap_started: float
    ) -> StepSnapshot:
        """The step's snapshot: what was fed (each cache row extended), the alarms in this order (the call's
        own, the feed's, positions', layers', waste), top-k, then the snapshot's fields. The caller made the
        forward's model the one in `use` (the probe's finish_forward, before `prepare`)."""
        at = f" [{call.caller}]"
        applied = self._applied(call)  # [batch][n]
        cache_len = introspect.seq_length(cache) if cache is not None else 0
        found = list(call.found)
        if cache_len < call.cache_length_before and track is not None and track.held is None and cache is call.cache:
            found += evictions.unread(call, track, cache, cache_len, step)  # a shrink no capture was set for
        stale = "stale-cache" in map(_CODE, found)  # its drift and position gap are the same cause
        rows, turn = self._cache_rows(call, track)
        masks = call.mask_new if call.mask_new is not None else [[1] * call.n] * call.batch  # [batch][n]
        fed_ids = self._feed(call, step, rows, turn, applied, masks, found, stale, at)
        alarms = call.track.alarms if call.track is not None else self._no_cache_alarms  # each cache its own
        found += check_positions(alarms, call, step, applied, masks, stale, at)
        infos, fingerprint = (
            introspect.infos_and_fingerprint(cache, call.probe.window) if cache is not None else ((), None)
        )
        if track is not None:  # (a cache the forward used: it has one)
            track.fingerprint = fingerprint  # for the next forward's edit check
        layers = checked_layers(alarms, call, step, cache, cache_len, infos, found)
        recomputed = self._count_waste(call, step, track, forward_ms, found, at) if call.n > 1 else 0
        top_rows = self._top(call, logits, call.batch)
        buffer = TokenBuffer(rows[0]) if rows else TokenBuffer([])  # row 0's: the snapshot's own
        row_views = self._row_views(call, fed_ids, applied, top_rows, buffer, rows) if call.batch > 1 else None
        seen = None
        if call.probe.attention is not None and rows and call.expected_start is None:
            ids = self.specials()[0]
            capture = call.probe.attention
            seen = (
                capture.finish(call.attention, buffer, turn, ids.pad, ids.pad_is_distinct)
                if call.attention is not None
                else capture.take(buffer, turn, ids.pad, ids.pad_is_distinct)
            )
            if seen is not None:
                memory = call.probe.attention.memory.setdefault(track.name if track else "", {})
                found += check_attention(
                    step, seen.pads, seen.detail.regions, seen.detail.shares, memory, at, len(buffer) - 1
                )
        requested = call.requested_positions[0] if call.requested_positions else None
        # the fields of less usual steps, only when they apply (a plain step leaves them at their defaults)
        extra: dict[str, Any] = {}
        if requested is not None:
            extra["requested_positions"] = tuple(requested)
        if call.requested_cache_position:
            extra["requested_cache_position"] = tuple(call.requested_cache_position)
        if track is not None and (track.parent is not None or track.unknown):
            extra.update(cache_parent=track.parent, cache_copied_at=track.copied_at, cache_unknown=track.unknown)
        if call.probe.attention is not None:
            extra.update(attention_off=self._attention_off(call, seen))
            if seen is not None:
                extra.update(attention=seen.layers, attention_layer=seen.detail.layer, attention_detail=seen.detail)
        if row_views is not None:
            extra["rows"] = row_views
        if recomputed:
            extra["recomputed"] = recomputed
        top = top_rows[0] if top_rows else ()
        return StepSnapshot(
            **self._site(call, track),
            **extra,
            step=step,
            turn=turn,
            input_ids=tuple(fed_ids[0]) if fed_ids else (),
            positions=tuple(applied[0]) if applied else (),
            cursor=self._cursor(call, requested, cache_len),
            cache_seq_length=cache_len,
            layers=layers,
            topk=top,
            topk_processed=top,
            watched=self._watched(logits) if self.watcher.watch_ids else (),
            diagnostics=tuple(found),
            forward_ms=forward_ms,
            snapshot_ms=(time.perf_counter() - snap_started) * 1000,
            buffer=buffer,
            cache_length_before=call.cache_length_before,
        )

    def _site(self, call: Call, track: CacheTrack | None) -> dict[str, Any]:
        """A watched snapshot's fields that stay the same over a loop's steps (its phase, call site, cache, model,
        thread and tokenizer), made once per set of values: a step passes only what changes (a call of more than
        15 keywords CPython builds an entry at a time, at twice the bytecode)."""
        name, capacity = (track.name, track.capacity) if track is not None else (None, None)
        phase = "prefill" if call.n > 1 else "decode"
        return _site_fields(
            phase,
            call.caller,
            name,
            capacity,
            call.probe.label,
            call.thread,
            call.positions_source,
            call.batch,
            self._texts,
        )

    @staticmethod
    def _attention_off(call: Call, seen) -> str | None:
        """Why a step of a watch with attention on carries none (None: it carries it)."""
        if seen is not None:
            return None
        if call.expected_start is not None:
            return "attention off: a compressed cache's key slots are not the buffer's positions (not mapped yet)"
        return call.probe.attention.off_reason()

    # the steps of build(), in its order: each one that raises alarms appends them to build's `found`

    @staticmethod
    def _cache_rows(call: Call, track: CacheTrack | None) -> tuple[list[list[BufferToken]], int]:
        """The cache's token rows ([batch][cached], extended by this forward) and the turn it is on (a prefill
        starts the next one)."""
        if track is not None:
            rows = track.rows
            if call.n > 1:
                track.turn += 1
            turn = track.turn
        else:
            rows, turn = [[] for _ in range(call.batch)], 0
        if len(rows) != call.batch:  # a cache now used with another batch size: buffers cannot line up
            rows[:] = [list(r) for r in (rows + [[]] * call.batch)[: call.batch]]
        return rows, turn

    def _feed(
        self,
        call: Call,
        step: int,
        rows: list[list[BufferToken]],
        turn: int,
        applied: list[list[int]],
        masks: list[list[int]],
        found: list[Diagnostic],
        stale: bool,
        at: str,
    ) -> list[list[int]]:
        """Each row's fed tokens onto its cache row (pads and tokenizer-added ids marked), row 0's checked
        against what it follows (`check_feed`, and drift from a tokenizer's rendering unless the cache is
        stale). Returns the fed ids, [batch][n] (-1 for inputs_embeds)."""
        ids_info, special = self.specials()
        added = self._tokenizer_added(call) if self._adding else ()  # (only encodings that added some are kept)
        fed_ids = []
        for row in range(call.batch):
            ids = call.input_ids[row] if call.input_ids is not None else [-1] * call.n
            pieces = self._texts.pieces_of(ids)  # the known ones in one pass
            fed = _fed_tokens(call.n, applied[row], ids, pieces, special, turn, masks[row], added if row == 0 else ())
            if row == 0:  # alarms read row 0; a program's rows share its code path
                if not feed_is_plain(fed, ids_info):
                    found += check_feed(
                        step,
                        fed,
                        rows[0][-1] if rows[0] else None,  # the token it follows
                        ids_info,
                        self.piece,
                        prompt_end=call.n > 1,
                        at=at,
                        label=lambda t: self.label(t.id),
                    )
                if not stale and len(ids) > 1:  # a feed of several tokens may be the tail of a rendering
                    found += self._check_drift(step, rows[0], ids, at)
            rows[row].extend(fed)
            fed_ids.append(ids)
        return fed_ids

    def _count_waste(
        self,
        call: Call,
        step: int,
        track: CacheTrack | None,
        forward_ms: float,
        found: list[Diagnostic],
        at: str,
    ) -> int:
        """For a prefill, the tokens it re-encoded that another cache of the same model held (`recomputed-prefix`),
        added to the watcher's totals. Returns that count."""
        if track is None or call.n <= 1 or call.input_ids is None:
            return 0
        watcher = self.watcher
        waste, count, cost = recomputed_prefix(
            step,
            track.name,
            call.cache_length_before,
            track.ids(),
            watcher.lineage.others(track, track.model),
            forward_ms,
            call.n,
            at,
        )
        found += waste
        watcher.recomputed_tokens += count
        watcher.recomputed_ms += cost
        return count

    @staticmethod
    def _cursor(call: Call, requested: list[int] | None, cache_len: int) -> int:
        """Where the next token goes, as the program asked: its cache_position, else its position_ids (with
        no mask: a mask's pads make positions and slots differ), else the cache's length."""
        if call.requested_cache_position:
            return call.requested_cache_position[-1] + 1
        if requested and call.mask_new is None:
            return requested[-1] + 1
        return cache_len

    def _watched(self, logits) -> tuple[TopToken, ...]:
        """The probabilities of the ids the front end watches (when it watches some), at row 0's last position."""
        if logits is not None:
            return watched_tokens(logits[0, -1].float(), self.watcher.watch_ids, self.piece)
        return ()

    @staticmethod
    def _row_views(
        call: Call,
        fed_ids: list[list[int]],
        applied: list[list[int]],
        top_rows: list[tuple],
        first: TokenBuffer,
        rows: list[list[BufferToken]],
    ) -> tuple[RowView, ...]:
        """Every row of a batched forward (the snapshot's own fields are row 0, `first` its buffer)."""
        buffers = [first, *map(TokenBuffer, rows[1:])]
        return tuple(
            RowView(
                row=r,
                input_ids=tuple(fed_ids[r]),
                positions=tuple(applied[r]),
                topk=top_rows[r],
                buffer=buffers[r],
            )
            for r in range(call.batch)
        )

    def _check_drift(self, step: int, row: list[BufferToken], ids: list[int], at: str) -> list[Diagnostic]:
        """The program fed the tail of a rendering a tokenizer call returned: its head must be what the cache holds."""
        if len(ids) < 2 or not row:
            return []
        cached = [t.id for t in row]
        for encoding, _ in reversed(self._encodings):
            start = len(encoding) - len(ids)
            if start > 0 and list(encoding[start:]) == ids:
                return check_drift(step, cached, encoding, ids, self.label, at)
        return []

    def _applied(self, call: Call) -> list[list[int]]:
        """The positions the model used, [batch][n]: read at its position module, else what it derives."""
        if "applied" in call.handles and call.reads is not None:
            if call.batch == 1:  # its [1, n] positions as read (prepare made them [batch, n])
                return [call.reads.flat(call.handles["applied"])]
            rows = call.reads.rows(call.handles["applied"])
            return rows if len(rows) == call.batch else [rows[0]] * call.batch
        if call.requested_positions is not None:
            return call.requested_positions
        start = call.cache_length_before  # 5.4+: no position_ids -> arange from the cache length
        return [list(range(start, start + call.n))] * call.batch

    def _top(self, call: Call, logits, batch: int) -> list[tuple]:
        if "top_ids" not in call.handles or call.reads is None:
            return [()] * batch
        reads, (values, logprobs, ids) = call.reads, map(call.handles.__getitem__, _TOP_HANDLES)
        texts = self._texts  # the texts in use (`use` set them), asked directly: known pieces in one pass
        if batch == 1:  # one row of the model's [1, k] top-k: its values as read, no split into rows
            return [
                top_row_from(reads.flat(values), reads.flat(logprobs), reads.flat(ids), texts.piece, texts.pieces_of)
            ]
        rows = top_rows_from(reads.rows(values), reads.rows(logprobs), reads.rows(ids), texts.piece, texts.pieces_of)
        return rows[:batch] + [()] * max(0, batch - len(rows))

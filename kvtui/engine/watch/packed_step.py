"""A continuous-batching forward watched: read per request before it runs, one snapshot row per fed request after.

A packed forward (`generate_batch`, `transformers serve --continuous-batching`) is many requests side by side
in one row over a paged cache: the single-sequence checks would read it as one sequence whose positions
restart (a false `position-gap`). Here it is read with batching/ (packed.py: what each request fed; lanes.py:
each request a lane; checks.py: positions and prefixes per request) and shown per request: `requests`
(every live lane), `paged` (the cache's groups) and one RowView per fed request, its buffer the lane's tokens.

Everything kvtui keeps lives in its own registries keyed weakly by the user's objects (the paged cache, its
batch processor): nothing is stored on them. Per forward: O(requests + fed tokens + blocks of the requests
in the batch), never O(tokens held) (a lane's buffer is an append-only list handed out as a TokenBuffer view).
"""

from __future__ import annotations

import sys
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..batching.checks import (
    check_request_positions,
    conversation_drift_diagnostic,
    edited_prefix_diagnostic,
    position_gap_diagnostic,
    recomputed_prefix_diagnostic,
    requeued_diagnostic,
    short_prompt_diagnostic,
    under_block_diagnostic,
)
from ..batching.lanes import Lane, LaneChanges, RequestLanes
from ..batching.packed import PackedForward, PackedRequest, find_batch_processor, int_list, read_packed_forward
from ..reading.attention import PAGED_NOTE
from ..reading.diagnostics import check_feed
from ..reading.edits import edit_words
from ..reading.prefixes import only_template_differs
from ..reading.topk import top_token_rows
from ..records.snapshot import (
    BufferToken,
    PagedGroupView,
    RequestView,
    RowView,
    StepSnapshot,
    TokenBuffer,
    TopToken,
)
from .patches import Registry
from .watch_step import Call

LOOP = "continuous batching loop"  # the caller of a packed forward with no program line on its stack
FRAMES_UP = 16  # from kvtui's own frame in begin_forward to the batch processor's (its hooks add four)


@dataclass
class PackedRun:
    """One paged cache's continuous-batching run as kvtui saw it (kvtui's object, keyed weakly by the cache)."""

    lanes: RequestLanes = field(default_factory=RequestLanes)
    buffers: dict[str, list[BufferToken]] = field(default_factory=dict)  # per request: what its cache holds
    processor: weakref.ref | None = None  # the batch processor last found for it
    changes: LaneChanges | None = None  # what the forward in flight changed (observed before it runs)


class PackedReader:
    """The runs of every paged cache a watcher met (the lanes of each, their buffers, the processor)."""

    def __init__(self) -> None:
        self.runs: Registry[PackedRun] = Registry()

    def begin(self, watcher, probe, kwargs: dict, cache, caller: str, thread: str | None) -> Call:
        """Read a packed forward before it runs: its requests, their lanes, the caller named as the loop."""
        run = self.runs.get(cache)
        if run is None:
            run = PackedRun()
            self.runs.add(cache, run)
        processor = run.processor() if run.processor is not None else None
        if processor is None or getattr(processor, "cache", None) is not cache:
            processor = find_batch_processor(sys._getframe(1), FRAMES_UP)
            try:
                run.processor = weakref.ref(processor) if processor is not None else None
            except TypeError:  # a processor without weak references: looked up again next forward
                run.processor = None
        packed = read_packed_forward(kwargs, processor, known=run.lanes)
        track = watcher.lineage.get(cache)
        if track is None:  # a paged cache: no edit patches (nothing of its class is wrapped), its name only
            track = watcher.lineage.first_seen(cache, probe.index, 0, 1, "program", None)
            watcher.emit(track.record())
        run.changes = run.lanes.observe(packed, watcher.steps + 1)
        fed = packed.requests
        return Call(
            probe=probe,
            caller=LOOP if caller == "?" or thread is not None else caller,
            thread=thread,
            n=packed.total_tokens,
            batch=len(fed),
            cache=cache,
            cache_length_before=fed[0].held_before if fed else 0,
            track=track,
            packed=packed,
            packed_run=run,
            logits_indices=int_list(kwargs.get("logits_indices")),
        )


def _only_template(builder, drift) -> bool:
    """The two differ in what a chat template renders (a special token, whitespace), not in the text itself: the
    one template-drift judgement (reading/prefixes.py), on both sides' tokens from the difference on."""
    _, special = builder.specials()
    return only_template_differs(drift.holder_tail, drift.tail, special, builder.piece)


def build_packed(builder, call: Call, step: int, track, logits, forward_ms: float, snap_started: float) -> StepSnapshot:
    """The snapshot of a packed forward: alarms per request, one row per fed request, every live lane."""
    packed: PackedForward = call.packed
    run: PackedRun = call.packed_run
    at = f" [{call.caller}]"
    found = list(call.found)
    found += [position_gap_diagnostic(f, step, at) for f in check_request_positions(packed)]
    recomputed = 0
    for miss in run.changes.misses if run.changes is not None else ():
        text = builder.label(miss.token) if miss.token is not None else None
        found.append(recomputed_prefix_diagnostic(miss, step, packed.prefix_sharing, text, at))
        recomputed += miss.count
    for resume in run.changes.resumed if run.changes is not None else ():
        found.append(requeued_diagnostic(resume, step, at))
        builder.watcher.requeued_tokens += resume.recomputed
    for drift in run.changes.drifts if run.changes is not None else ():
        if _only_template(builder, drift):
            have, want = builder.label(drift.token), builder.label(drift.holder_token)
            found.append(conversation_drift_diagnostic(drift, step, have, want, at))
    for edit in run.changes.edits if run.changes is not None else ():
        recomputed += edit.count  # computed again either way (the lane's `recomp` counts it too)
        _, special = builder.specials()
        if only_template_differs(edit.holder_tail, edit.tail, special, builder.piece):
            continue  # what differs is the chat template's rendering (template-drift's business), not the text
        have, want = builder.label(edit.tail[0]), builder.label(edit.holder_tail[0])
        words = edit_words(edit.holder_tail, edit.tail, 0, edit.edit, lambda ids: "".join(map(builder.piece, ids)))
        found.append(edited_prefix_diagnostic(edit, step, have, want, words, at))
    for short in run.changes.short if run.changes is not None else ():
        found.append(
            short_prompt_diagnostic(short.request_id, short.prompt_length, short.block_tokens, short.count, step, at)
        )
    for finding, count in run.changes.under if run.changes is not None else ():
        found.append(under_block_diagnostic(finding, count, step, at))
    builder.watcher.recomputed_tokens += recomputed
    rows = _rows(builder, call, run, packed, logits, track.turn if track is not None else 0, step, found)
    first = packed.requests[0] if packed.requests else None
    lead = rows[0] if rows else None
    return StepSnapshot(
        step=step,
        phase="prefill" if any(r.is_prefill for r in packed.requests) else "decode",
        turn=track.turn if track is not None else 0,
        input_ids=lead.input_ids if lead else (),
        positions=lead.positions if lead else (),
        cursor=first.held_after if first else 0,
        cache_seq_length=first.held_after if first else 0,
        capacity=None,
        layers=(),
        topk=lead.topk if lead else (),
        topk_processed=lead.topk if lead else (),
        watched=(),
        chosen=None,
        chosen_forced=False,
        diagnostics=tuple(found),
        forward_ms=forward_ms,
        snapshot_ms=(time.perf_counter() - snap_started) * 1000,
        buffer=lead.buffer if lead else TokenBuffer([]),
        source="watch",
        caller=call.caller,
        cache_id=track.name if track else None,
        cache_length_before=call.cache_length_before,
        positions_source="packed",
        batch=len(rows),
        rows=rows,
        model=call.probe.label,
        thread=call.thread,
        recomputed=recomputed,
        requests=_request_views(run, packed),
        token_bytes=builder.token_bytes,
        attention_off=f"attention off: {PAGED_NOTE}" if call.probe.attention is not None else None,
        paged=tuple(
            PagedGroupView(g.name, len(g.layers), g.block_tokens, g.total, g.used, g.free, g.shared, g.cached)
            for g in packed.groups
        ),
    )


def _rows(
    builder, call: Call, run: PackedRun, packed: PackedForward, logits, turn: int, step: int, found: list
) -> tuple[RowView, ...]:
    """One row per fed request: its fed tokens onto its buffer (judged per request by check_feed: end tokens,
    pads, a doubled BOS), its top-k where the forward sampled it."""
    ids_info, special = builder.specials()
    tops = _top_per_request(builder, packed, call.logits_indices, logits)
    rows = []
    for i, request in enumerate(packed.requests):
        items = run.buffers.get(request.request_id)
        shared = 0
        if items is None:
            items = run.buffers[request.request_id] = _held_prefix(builder, run, request, special, turn)
            shared = len(items)
        elif len(items) > request.held_before:  # requeued and prefilled again: a new list, views stay valid
            items = run.buffers[request.request_id] = items[: request.held_before]
        fed = [
            BufferToken(
                position=position,
                id=token,
                piece=builder.piece(token),
                special=token in special,
                origin="fed",
                turn=turn,
            )
            for token, position in zip(request.fed_ids, request.positions)
        ]
        found += check_feed(
            step,
            fed,
            items[-1] if items else None,
            ids_info,
            builder.piece,
            prompt_end=request.is_prefill and request.held_after >= request.prompt_length > 0,
            at=f" (request {request.request_id}) [{call.caller}]",
            label=lambda t: builder.label(t.id),
        )
        items.extend(fed)
        rows.append(
            RowView(
                row=i,
                input_ids=request.fed_ids,
                positions=request.positions,
                topk=tops[i],
                buffer=TokenBuffer(items),
                request_id=request.request_id,
                shared_prefix=shared,
            )
        )
    _forget_finished(run)
    return tuple(rows)


def _held_prefix(builder, run: PackedRun, request: PackedRequest, special, turn: int) -> list[BufferToken]:
    """A request first seen holding tokens (a prefix match shared them): its prompt's first ones (once)."""
    lane = run.lanes.get(request.request_id)
    prompt = lane.tokens[: request.held_before] if lane is not None else []
    return [
        BufferToken(position=i, id=t, piece=builder.piece(t), special=t in special, origin="fed", turn=turn)
        for i, t in enumerate(prompt)
    ]


def _forget_finished(run: PackedRun) -> None:
    """Buffers of lanes the run no longer remembers (RequestLanes keeps a bounded number of finished ones)."""
    if len(run.buffers) > len(run.lanes):
        for request_id in [r for r in run.buffers if r not in run.lanes.lanes]:
            del run.buffers[request_id]


def _top_per_request(builder, packed: PackedForward, indices: Sequence[int], logits) -> list[tuple[TopToken, ...]]:
    """Top-k of each request whose next token this forward samples. Logits come back [1, len(indices), vocab]
    with logits_to_keep (the rows at logits_indices), or [1, total, vocab] without it."""
    empty: list[tuple[TopToken, ...]] = [() for _ in packed.requests]
    if logits is None or getattr(logits, "dim", lambda: 0)() != 3 or not indices:
        return empty
    kept = logits.shape[1] == len(indices)
    wanted, where = [], []
    for i, request in enumerate(packed.requests):
        last = request.end - 1
        if last in indices:  # the first match: padded entries repeat 0 after the real ones
            wanted.append(indices.index(last) if kept else last)
            where.append(i)
    if not wanted or max(wanted) >= logits.shape[1]:
        return empty
    scores = logits[0, wanted]  # [requests sampled, vocab]
    for i, top in zip(where, top_token_rows(scores, builder.watcher.top_k, builder.piece)):
        empty[i] = top
    return empty


def _request_views(run: PackedRun, packed: PackedForward) -> tuple[RequestView, ...]:
    """Every live lane (and those finished by this forward): the fed ones first, in packing order."""
    fed = {r.request_id: r for r in packed.requests}
    just_finished = set(run.changes.finished) if run.changes is not None else set()
    order = [run.lanes.get(r.request_id) for r in packed.requests]
    order += [
        lane
        for lane in run.lanes
        if lane.request_id not in fed and (not lane.finished or lane.request_id in just_finished)
    ]
    return tuple(_request_view(lane, fed.get(lane.request_id)) for lane in order if lane is not None)


def _request_view(lane: Lane, request: PackedRequest | None) -> RequestView:
    blocks = request.blocks if request is not None else lane.blocks
    generated = request.generated if request is not None else max(0, lane.held - lane.prompt_length)
    if lane.requeued:  # a soft reset moves what it generated into transformers' prompt: count from kvtui's own
        generated = max(0, lane.held - lane.prompt_length)
    return RequestView(
        request_id=lane.request_id,
        status=lane.status,
        phase=request.phase if request is not None else "",
        fed=request.n if request is not None else 0,
        held=lane.held,
        prompt_length=lane.prompt_length,
        generated=generated,
        prefix_hit=lane.prefix_hit,
        recomputed=lane.recomputed,
        blocks=tuple((b.group, b.blocks) for b in blocks),
        shared=sum(len(b.shared) for b in blocks),
        requeued=lane.requeued,
        reprefilled=lane.reprefilled,
    )

"""Every request a lane: what each request of a continuous-batching run held, fed and shared, forward after forward.

One packed forward says what it fed; some facts need the forwards before it: a request first seen with
tokens already held got them from a prefix match (a split prefill's later chunk does not), a request that
stops appearing while the scheduler no longer holds it has finished, and a prefill re-encoding a prefix is
judged against what the other requests held before it. `RequestLanes` keeps that in kvtui's own objects
(never on the user's): per forward O(requests in the batch + fed tokens), plus the prompt comparison of
the requests that prefill.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from ..reading.edits import short_prompt
from ..records.snapshot import frozen
from .checks import (
    ConversationDrift,
    EditedPrefix,
    PrefixMiss,
    UnderBlock,
    conversation_drift,
    edited_prefix,
    prefix_miss,
    under_block,
)
from .packed import DECODE, PackedForward, PackedRequest, RequestBlocks

WAITING = "waiting"
PREFILLING = "prefilling"
DECODING = "decoding"
FINISHED = "finished"
KEEP_FINISHED = 64  # finished lanes remembered (their tokens judge later prefills); the oldest go first


@dataclass
class Lane:
    """One request as kvtui has seen it so far (kvtui's object: mutable, holds no tensor)."""

    request_id: str
    tokens: list[int] = field(default_factory=list)  # prompt + generated ids, in order (only what kvtui saw)
    held: int = 0  # tokens its cache holds (after the last forward that fed it)
    status: str = WAITING  # waiting, prefilling, decoding, finished (by what kvtui saw it fed, not transformers'
    # status, which reads "decoding" already while the last chunk of a prefill runs)
    requeued: int = 0  # times it went back to waiting after being fed (offloaded or soft-reset under memory pressure)
    held_at_requeue: int = 0  # tokens its cache held when it last went back to waiting
    reprefilled: int = 0  # tokens it computed again after coming back (what its cache had held and lost)
    phase: str = ""  # what the last forward fed it: prefill, prefill-chunk, decode
    prompt_length: int = 0
    prefix_hit: int = 0  # tokens its cache held when first scheduled: a prefix match shared them
    recomputed: int = 0  # tokens its prefills re-encoded that another request held
    forwards: int = 0  # forwards that fed it
    first_step: int = 0  # the step that first fed it (0: not fed yet)
    last_step: int = 0
    requeued_at: int = 0  # the step that last saw it back in waiting
    blocks: tuple[RequestBlocks, ...] = ()  # per cache group, as of the last forward that fed it

    @property
    def finished(self) -> bool:
        return self.status == FINISHED


@frozen
class LaneChanges:
    """What one forward changed in the lanes."""

    arrived: tuple[str, ...]  # requests seen for the first time (waiting or fed)
    finished: tuple[str, ...]  # requests the scheduler no longer holds
    requeued: tuple[str, ...]  # requests fed before and waiting again (offloaded, or soft-reset to re-prefill)
    misses: tuple[PrefixMiss, ...]  # prefills of this forward that re-encoded another request's tokens
    resumed: tuple[Resume, ...] = ()  # requests fed again after going back to waiting
    drifts: tuple[ConversationDrift, ...] = ()  # new requests that re-rendered a finished one's conversation
    edits: tuple[EditedPrefix, ...] = ()  # new prompts that left another request's tokens where its text goes on
    short: tuple[ShortPrompt, ...] = ()  # a short-prompt note due (the first, then one per doubling of the count)
    under: tuple[tuple[UnderBlock, int], ...] = ()  # a prefix-under-block note due, with the count so far (the same)


@frozen
class ShortPrompt:
    """New prompts shorter than one block of a cache that shares prefixes: nothing of them can be shared."""

    request_id: str  # the one that brought the count to a note
    prompt_length: int
    block_tokens: int
    count: int  # such prompts so far in this run


@frozen
class Resume:
    """A request fed again after the scheduler sent it back to waiting (its blocks were needed by others)."""

    request_id: str
    held_before: int  # tokens its cache held when it went back to waiting
    kept: int  # of them, held again as it resumes (restored from the CPU copy; 0: soft reset, all computed again)
    requeued_at: int  # the step it went back to waiting (the first forward that saw it waiting)
    step: int  # the step it resumed

    @property
    def recomputed(self) -> int:
        return max(0, self.held_before - self.kept)


class RequestLanes:
    """The lanes of one continuous-batching run (one paged cache), fed one PackedForward at a time."""

    def __init__(self, keep_finished: int = KEEP_FINISHED) -> None:
        self.lanes: dict[str, Lane] = {}  # by request id, in arrival order
        self.keep_finished = keep_finished
        self.short_prompts = 0  # new prompts shorter than one block (with prefix sharing on): they share nothing
        self._short_noted = 0  # the count at the last short-prompt note (the next at twice it)
        self.under_block = 0  # new prompts whose start shared with a held request is under one block: none reused
        self._under_noted = 0

    def __contains__(self, request_id: object) -> bool:
        """read_packed_forward(known=lanes): prompts are read once, for the requests not seen yet."""
        lane = self.lanes.get(request_id) if isinstance(request_id, str) else None
        return lane is not None and lane.forwards > 0

    def __iter__(self) -> Iterator[Lane]:
        return iter(self.lanes.values())

    def __len__(self) -> int:
        return len(self.lanes)

    def get(self, request_id: str) -> Lane | None:
        return self.lanes.get(request_id)

    def observe(self, packed: PackedForward, step: int = 0) -> LaneChanges:
        """Fold one forward in (call it before the forward runs, with what read_packed_forward read)."""
        arrived = []
        block_tokens = packed.groups[0].block_tokens if packed.groups else 0
        # what every other request held before this forward (this forward's own prefills are not "before")
        # live: still scheduled (a request that finished while the server was idle is not, though kvtui has not
        # marked it finished yet: no forward came between)
        scheduled = set(packed.active) | set(packed.waiting) | {r.request_id for r in packed.requests}
        known = bool(packed.active)  # the scheduler was read (else every unfinished lane counts as live)
        others = [
            (lane.request_id, lane.tokens, lane.held, not lane.finished and (not known or lane.request_id in scheduled))
            for lane in self.lanes.values()
        ]
        misses = []
        resumed = []
        drifts = []
        edits = []
        short = []
        under = []
        for request in packed.requests:
            lane = self.lanes.get(request.request_id)
            if lane is None:
                lane = self.lanes[request.request_id] = Lane(request.request_id)
                arrived.append(request.request_id)
            first = lane.forwards == 0
            if not first and lane.status == WAITING:  # back from waiting: what did it keep?
                resume = Resume(request.request_id, lane.held_at_requeue, request.held_before, lane.requeued_at, step)
                lane.reprefilled += resume.recomputed
                resumed.append(resume)
            if first:
                self._first_sight(lane, request, step)
                if request.is_prefill and lane.tokens:
                    done = [(o.request_id, o.tokens, o.prompt_length) for o in self.lanes.values() if o.finished]
                    drift = conversation_drift(request.request_id, lane.tokens, done)
                    if drift is not None:
                        drifts.append(drift)
                    edit = edited_prefix(request.request_id, lane.tokens, others)
                    if edit is not None:
                        edits.append(edit)
                        lane.recomputed += edit.count
                    elif (
                        packed.prefix_sharing
                        and request.held_before == 0
                        and not short_prompt(request.prompt_length, block_tokens)
                    ):
                        found = under_block(request.request_id, lane.tokens, others, block_tokens)
                        if found is not None:
                            self.under_block += 1
                            if self.under_block >= 2 * self._under_noted:
                                self._under_noted = self.under_block
                                under.append((found, self.under_block))
                if request.is_prefill and packed.prefix_sharing and short_prompt(request.prompt_length, block_tokens):
                    self.short_prompts += 1
                    if self.short_prompts >= 2 * self._short_noted:
                        self._short_noted = max(1, self.short_prompts)
                        short.append(
                            ShortPrompt(request.request_id, request.prompt_length, block_tokens, self.short_prompts)
                        )
            if request.is_prefill:
                miss = prefix_miss(request, lane.tokens, others, block_tokens, packed.prefix_sharing)
                if miss is not None:
                    misses.append(miss)
                    lane.recomputed += miss.count
            elif not first:
                lane.tokens.extend(request.fed_ids)  # a decode feeds the token generated last
            lane.held = request.held_after
            lane.status = PREFILLING if request.is_prefill else DECODING
            lane.phase, lane.blocks = request.phase, request.blocks
            lane.forwards += 1
            lane.last_step = step
        requeued = []
        for request_id in packed.waiting:
            lane = self.lanes.get(request_id)
            if lane is None:
                self.lanes[request_id] = Lane(request_id)
                arrived.append(request_id)
            elif lane.forwards and lane.status != WAITING:
                lane.status = WAITING
                lane.requeued += 1
                lane.held_at_requeue, lane.requeued_at = lane.held, step
                requeued.append(request_id)
        finished = self._finish(packed)
        return LaneChanges(
            arrived=tuple(arrived),
            finished=finished,
            requeued=tuple(requeued),
            misses=tuple(misses),
            resumed=tuple(resumed),
            drifts=tuple(drifts),
            edits=tuple(edits),
            short=tuple(short),
            under=tuple(under),
        )

    def _first_sight(self, lane: Lane, request: PackedRequest, step: int) -> None:
        lane.tokens = list(request.prompt_ids or ())
        lane.prompt_length = request.prompt_length
        lane.first_step = step
        if request.phase == DECODE:
            lane.tokens.extend(request.fed_ids)  # seen first while decoding (kvtui attached late)
        elif request.held_before > 0:
            lane.prefix_hit = request.held_before

    def _finish(self, packed: PackedForward) -> tuple[str, ...]:
        """Lanes the scheduler no longer holds (and that are not waiting) have finished."""
        live = set(packed.active) | set(packed.waiting) | {r.request_id for r in packed.requests}
        finished = []
        for lane in self.lanes.values():
            if not lane.finished and lane.forwards and lane.request_id not in live:
                lane.status = FINISHED
                finished.append(lane.request_id)
        done = [lane.request_id for lane in self.lanes.values() if lane.finished]
        for request_id in done[: max(0, len(done) - self.keep_finished)]:
            del self.lanes[request_id]
        return tuple(finished)

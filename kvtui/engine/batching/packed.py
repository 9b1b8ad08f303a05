"""Reads one continuous-batching forward of transformers: which requests it packed, what each fed, its blocks.

A packed forward is not one sequence: `model(**batch_data)` gets every scheduled request's tokens side by
side in one row (`input_ids` [1, total]), with `cu_seq_lens_q` marking where each request's slice starts
and `position_ids` counting per request. The batch processor that built it (its `.scheduler`, `.cache`,
`.inputs_and_outputs`) knows which request owns which slice; the paged cache (`PagedAttentionCache`) holds
each request's block table per cache group and the ledger of shared blocks: read by reading/introspect/paged.py
(the cache's internals are read in reading/ only; here the batch processor's requests and inputs).

Everything is duck-typed (the layout changed across 5.x and 4.57 may have no continuous batching at all):
nothing here imports transformers. The reading keeps no tensor and reads no K/V: per forward it costs
O(requests + fed tokens + blocks of the requests in the batch), never O(tokens held).
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from types import FrameType
from typing import Any

from ..reading.introspect.paged import (
    Allocator,
    CacheGroup,
    RequestBlocks,
    allocators_of,
    cache_groups,
    paged_layout,
    request_blocks,
)
from ..records.snapshot import frozen

__all__ = ["CacheGroup", "RequestBlocks"]  # the paged cache's values, read in reading/ (lanes use them from here)

# the forward's cache argument: `cache` from 5.24, `past_key_values` before
CACHE_ARGUMENTS = ("cache", "past_key_values")
# where the batch processor is up the stack: 5.x ContinuousBatchProcessor._generation_step's self (2 frames
# above the forward's caller, ModelRunner._forward_process_and_sample); 4.57 the manager's _generation_step
# argument (its forward's caller is the manager's _model_forward, behind tracing wrappers)
PROCESSOR_LOCALS = ("self", "batch_processor")
FRAMES_UP = 12

PREFILL = "prefill"  # the forward feeds a whole prompt from its first token
PREFILL_CHUNK = "prefill-chunk"  # a piece of a prompt: a split prefill, or the rest after a prefix hit
DECODE = "decode"  # the forward feeds a generated token


@frozen
class PackedRequest:
    """One request's part of a packed forward."""

    request_id: str  # the id transformers (or the server) gave it: "req_0", a server's uuid, ...
    start: int  # its slice of the packed row: input_ids[0, start:end]
    end: int
    fed_ids: tuple[int, ...]  # the token ids this forward feeds for it
    positions: tuple[int, ...]  # the position ids they were fed with
    phase: str  # PREFILL, PREFILL_CHUNK or DECODE
    status: str  # transformers' RequestStatus, lower case ("prefilling", "decoding"; the last chunk of a
    # prefill already reads "decoding": the scheduler sets it before the forward)
    held_before: int  # tokens its cache held before this forward (prompt + generated so far)
    prompt_length: int  # its prompt's tokens
    generated: int  # tokens generated so far (the one this forward feeds in a decode included)
    planned: int  # tokens the scheduler planned for it (equals end - start unless the batch is inconsistent)
    blocks: tuple[RequestBlocks, ...]  # per cache group
    prompt_ids: tuple[int, ...] | None = None  # its prompt, only for requests the caller did not know yet

    @property
    def n(self) -> int:
        return self.end - self.start

    @property
    def held_after(self) -> int:
        return self.held_before + self.n

    @property
    def is_prefill(self) -> bool:
        return self.phase != DECODE

    @property
    def shared_blocks(self) -> int:
        return sum(len(group.shared) for group in self.blocks)


@frozen
class PackedForward:
    """One continuous-batching forward, read before it runs."""

    requests: tuple[PackedRequest, ...]  # in packing order
    groups: tuple[CacheGroup, ...]  # the paged cache's totals per group, () when its layout is unknown
    total_tokens: int  # real tokens of the packed row (the row may be padded past this)
    prefix_sharing: bool  # the cache looks up prompts' prefixes in its ledger (use_prefix_sharing)
    block_sharing: bool  # the config allows block sharing (allow_block_sharing)
    active: tuple[str, ...]  # ids of the requests the scheduler holds (prefilling, decoding), this batch's included
    waiting: tuple[str, ...]  # ids of the requests waiting to be scheduled
    layout: str  # "allocators" (5.24: cache_allocators with block tables and ledgers), "group-managers" (4.57:
    # block tables, no sharing) or "unknown" (requests and positions read, no blocks)

    def request(self, request_id: str) -> PackedRequest | None:
        return next((r for r in self.requests if r.request_id == request_id), None)


def cache_argument(kwargs: Mapping[str, Any]) -> Any:
    """The cache object a forward was given, under either name."""
    for name in CACHE_ARGUMENTS:
        cache = kwargs.get(name)
        if cache is not None:
            return cache
    return None


def is_packed_forward(kwargs: Mapping[str, Any]) -> bool:
    """A continuous-batching forward: packed per-request boundaries and a paged cache (cheap: every forward)."""
    if "cu_seq_lens_q" not in kwargs:
        return False
    cache = cache_argument(kwargs)
    return cache is not None and (
        hasattr(cache, "cache_allocators") or hasattr(cache, "group_cache_managers") or "Paged" in type(cache).__name__
    )


def is_batch_processor(owner: Any) -> bool:
    """A continuous batch processor: a scheduler, a paged cache and the batch (5.x: inputs_and_outputs; 4.57:
    requests_in_batch)."""
    return (
        hasattr(owner, "scheduler")
        and hasattr(owner, "cache")
        and (hasattr(owner, "inputs_and_outputs") or hasattr(owner, "requests_in_batch"))
    )


def find_batch_processor(frame: FrameType | None, depth: int = FRAMES_UP) -> Any:
    """The batch processor that built this forward: the first `self` (or `batch_processor` argument, 4.57) up the
    stack that is one. `frame`: the forward's caller's frame. None when not found within `depth` frames."""
    while frame is not None and depth > 0:
        for name in PROCESSOR_LOCALS:
            owner = frame.f_locals.get(name)
            if owner is not None and is_batch_processor(owner):
                return owner
        frame, depth = frame.f_back, depth - 1
    return None


def read_packed_forward(kwargs: Mapping[str, Any], processor: Any, known: Container[str] = ()) -> PackedForward:
    """What this packed forward feeds per request and what the paged cache holds, as plain values.

    `processor`: find_batch_processor's answer (None, or a batch that does not match the packed slices: the
    requests are read from the packed inputs alone, named by their slice "#0", "#1", ..., status "unknown").
    `known`: request ids the caller has seen before; the others carry their prompt ids (read once per request,
    so the cost stays per forward O(requests + fed + blocks))."""
    bounds = int_list(kwargs.get("cu_seq_lens_q"))  # [requests + 1], padded batches repeat the last value
    total = bounds[-1] if bounds else 0
    ids = _row(kwargs.get("input_ids"), total)  # [total]
    positions = _row(kwargs.get("position_ids"), total)  # [total]
    cache = cache_argument(kwargs)
    if cache is None and processor is not None:
        cache = getattr(processor, "cache", None)
    states = _batch_states(processor, bounds)
    allocators = allocators_of(cache)
    requests = []
    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        if end <= start and i >= len(states):
            continue  # a padding sequence (empty slice)
        state, planned = states[i] if i < len(states) else (None, end - start)
        requests.append(_request(i, start, end, ids, positions, state, planned, allocators, known))
    scheduler = getattr(processor, "scheduler", None)
    return PackedForward(
        requests=tuple(requests),
        groups=cache_groups(cache, allocators),
        total_tokens=total,
        prefix_sharing=bool(getattr(cache, "use_prefix_sharing", False)),
        block_sharing=bool(getattr(cache, "allow_block_sharing", False)),
        active=tuple(str(r) for r in getattr(scheduler, "active_requests", None) or ()),
        waiting=tuple(str(r) for r in getattr(scheduler, "waiting_requests", None) or ()),
        layout=paged_layout(cache),
    )


def int_list(value: Any) -> list[int]:
    """A tensor, list or None of a forward's small index arguments as plain ints (one host transfer)."""
    if value is None:
        return []
    if hasattr(value, "tolist"):
        value = value.tolist()
    return [int(v) for v in value]


def _row(value: Any, total: int) -> list[int]:
    """The packed row's first `total` entries: input_ids / position_ids are [1, padded total]."""
    if value is None:
        return []
    if getattr(value, "ndim", 1) > 1:
        value = value[0]
    return int_list(value[:total])


def _batch_states(processor: Any, bounds: list[int]) -> list[tuple[Any, int]]:
    """(RequestState, planned query length) per packed request, in packing order."""
    io = getattr(processor, "inputs_and_outputs", None)
    if io is None:  # 4.57: the processor holds the batch's RequestStates itself
        io = processor
    if hasattr(io, "requests_in_batch"):
        candidates = [io]
    else:  # async batching: two IO pairs, swapped (get_cb_kwargs) just before the forward runs
        pairs = getattr(io, "io_pairs", None) or []
        current = getattr(io, "current_pair", 0)
        ordered = [pairs[1 - current], pairs[current]] if len(pairs) == 2 else list(pairs)
        candidates = [getattr(pair, "host_io", pair) for pair in ordered]
    sizes = [end - start for start, end in zip(bounds, bounds[1:])]
    for candidate in candidates:
        batch = list(getattr(candidate, "requests_in_batch", None) or [])
        planned = [_planned(future) for future in batch]
        if batch and planned == sizes[: len(planned)]:
            return [(getattr(future, "state", future), n) for future, n in zip(batch, planned)]
    # no batch matches the packed slices (a layout kvtui does not know): pairing by order could give a request
    # another's tokens and raise a false position-gap, so the forward is read from its packed inputs alone
    return []


def _planned(future: Any) -> int:
    """Tokens the scheduler planned for a request: 5.x FutureRequestState.query_length; 4.57 its RequestState's
    prompt_ids (the tokens being processed)."""
    if hasattr(future, "query_length"):
        return int(future.query_length)
    return len(getattr(future, "prompt_ids", None) or ())


def _request(
    i: int,
    start: int,
    end: int,
    ids: list[int],
    positions: list[int],
    state: Any,
    planned: int,
    allocators: list[Allocator],
    known: Container[str],
) -> PackedRequest:
    n = end - start
    fed = tuple(ids[start:end])
    applied = tuple(positions[start:end])
    if state is None:  # no processor: what the packed inputs alone say
        return PackedRequest(
            request_id=f"#{i}",
            start=start,
            end=end,
            fed_ids=fed,
            positions=applied,
            phase=PREFILL if n > 1 else DECODE,
            status="unknown",
            held_before=applied[0] if applied else 0,
            prompt_length=0,
            generated=0,
            planned=planned,
            blocks=(),
        )
    request_id = str(getattr(state, "request_id", f"#{i}"))
    # 5.x initial_tokens / generated_tokens; 4.57 full_prompt_ids / static_outputs
    prompt = getattr(state, "initial_tokens", None) or getattr(state, "full_prompt_ids", None) or []
    generated = len(getattr(state, "generated_tokens", None) or getattr(state, "static_outputs", None) or ())
    # prepare_batch_tensors advanced position_offset by the planned length before the forward
    held_before = int(getattr(state, "position_offset", 0)) - planned
    status = getattr(state, "status", None)
    return PackedRequest(
        request_id=request_id,
        start=start,
        end=end,
        fed_ids=fed,
        positions=applied,
        phase=_phase(held_before, n, len(prompt)),
        status=str(getattr(status, "name", status)).lower(),
        held_before=held_before,
        prompt_length=len(prompt),
        generated=generated,
        planned=planned,
        blocks=tuple(request_blocks(allocator, request_id) for allocator in allocators),
        prompt_ids=None if request_id in known else tuple(int(t) for t in prompt),
    )


def _phase(held_before: int, n: int, prompt_length: int) -> str:
    if held_before >= prompt_length:
        return DECODE
    if held_before == 0 and n >= prompt_length:
        return PREFILL
    return PREFILL_CHUNK

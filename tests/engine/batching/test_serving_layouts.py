"""The packed-forward reader on the layouts it cannot run here: 4.57's batch processor, no processor at all."""

from __future__ import annotations

import sys
from collections import deque
from types import SimpleNamespace

import torch

from kvtui.engine.batching.checks import check_request_positions
from kvtui.engine.batching.lanes import RequestLanes
from kvtui.engine.batching.packed import (
    DECODE,
    PREFILL,
    PREFILL_CHUNK,
    find_batch_processor,
    is_packed_forward,
    read_packed_forward,
)


class PagedAttentionCache:
    """4.57's layout: a block table per request in each group manager, one free list, no sharing ledger."""

    def __init__(self, tables: dict[str, list[int]]) -> None:
        self.group_cache_managers = [FullAttentionCacheAllocator(tables)]
        self._free_blocks = deque(range(20, 30))
        self.num_blocks = 32
        self.block_size = 4
        self.layer_index_to_group_indices = {0: (0, 0), 1: (0, 1)}


class FullAttentionCacheAllocator:
    def __init__(self, tables: dict[str, list[int]]) -> None:
        self._index = 0
        self.block_size = 4
        self._block_table = tables


def _state(request_id: str, prompt: list[int], fed: list[int], offset: int, generated: list[int]):
    """4.57's RequestState: prompt_ids are the tokens being processed; position_offset already advanced."""
    return SimpleNamespace(
        request_id=request_id,
        full_prompt_ids=prompt,
        prompt_ids=fed,
        static_outputs=generated,
        position_offset=offset,
        status=SimpleNamespace(name="DECODING"),
    )


def _forward():
    """A packed forward of 4.57: a 6-token prompt whole, a 5-token prompt's second chunk, a decode."""
    a = _state("a", [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], 6, [])
    b = _state("b", [1, 2, 3, 9, 9], [9, 9], 5, [])
    c = _state("c", [7, 8, 9], [40], 4, [40])
    cache = PagedAttentionCache({"a": [0, 1], "b": [2, 3], "c": [4]})
    processor = SimpleNamespace(
        scheduler=SimpleNamespace(active_requests={"a": a, "b": b, "c": c}, waiting_requests={"d": None}),
        cache=cache,
        requests_in_batch=[a, b, c],
    )
    kwargs = {
        "input_ids": torch.tensor([[1, 2, 3, 4, 5, 6, 9, 9, 40]]),
        "position_ids": torch.tensor([[0, 1, 2, 3, 4, 5, 3, 4, 3]]),
        "cu_seq_lens_q": torch.tensor([0, 6, 8, 9]),
        "cache": cache,
    }
    return kwargs, processor


def test_the_457_layout_is_read():
    kwargs, processor = _forward()
    assert is_packed_forward(kwargs)

    def _generation_step(batch_processor):  # 4.57: the processor is the manager's argument, not a self
        return _model_forward()

    def _model_forward():
        return find_batch_processor(sys._getframe(1))

    assert _generation_step(processor) is processor
    packed = read_packed_forward(kwargs, processor, known={"c"})
    assert packed.layout == "group-managers"
    assert [(r.request_id, r.phase, r.held_before, r.fed_ids, r.positions) for r in packed.requests] == [
        ("a", PREFILL, 0, (1, 2, 3, 4, 5, 6), (0, 1, 2, 3, 4, 5)),
        ("b", PREFILL_CHUNK, 3, (9, 9), (3, 4)),
        ("c", DECODE, 3, (40,), (3,)),
    ]
    assert [r.prompt_ids for r in packed.requests] == [(1, 2, 3, 4, 5, 6), (1, 2, 3, 9, 9), None]  # c is known
    assert [r.blocks[0].blocks for r in packed.requests] == [(0, 1), (2, 3), (4,)]
    assert packed.requests[2].generated == 1 and packed.requests[2].status == "decoding"
    (group,) = packed.groups
    assert (group.name, group.layers, group.block_tokens, group.total, group.used, group.free) == (
        "full_attention",
        (0, 1),
        4,
        32,
        5,
        10,
    )
    assert (packed.active, packed.waiting, packed.prefix_sharing) == (("a", "b", "c"), ("d",), False)
    assert check_request_positions(packed) == []


def test_without_the_processor_positions_are_checked_for_contiguity():
    kwargs, _ = _forward()
    packed = read_packed_forward(kwargs, None)
    assert [r.request_id for r in packed.requests] == ["#0", "#1", "#2"]
    assert packed.layout == "group-managers" and packed.requests[1].blocks == ()
    assert check_request_positions(packed) == []
    kwargs["position_ids"] = torch.tensor([[0, 1, 2, 4, 5, 6, 3, 4, 3]])
    (finding,) = check_request_positions(packed := read_packed_forward(kwargs, None))
    assert (finding.request_id, finding.token, finding.position, finding.expected) == ("#0", 3, 4, 3)
    assert packed.requests[0].positions == (0, 1, 2, 4, 5, 6)


def test_lanes_follow_requests_that_wait_again_and_finish():
    kwargs, processor = _forward()
    lanes = RequestLanes()
    first = lanes.observe(read_packed_forward(kwargs, processor, known=lanes), step=1)
    assert (first.arrived, first.finished, first.requeued) == (("a", "b", "c", "d"), (), ())
    assert [(lane.request_id, lane.status, lane.held) for lane in lanes] == [
        ("a", "prefilling", 6),  # what this forward does for it (transformers already says "decoding")
        ("b", "prefilling", 5),
        ("c", "decoding", 4),
        ("d", "waiting", 0),
    ]
    assert lanes.get("b").prefix_hit == 3  # first seen holding 3 tokens it was not fed here
    # next forward: a decodes, b was offloaded (waiting again), c has finished
    a = processor.requests_in_batch[0]
    a.prompt_ids, a.position_offset, a.static_outputs = [50], 7, [50]
    processor.requests_in_batch = [a]
    processor.scheduler = SimpleNamespace(active_requests={"a": a}, waiting_requests={"d": None, "b": None})
    kwargs = dict(kwargs, input_ids=torch.tensor([[50]]), position_ids=torch.tensor([[6]]))
    kwargs["cu_seq_lens_q"] = torch.tensor([0, 1])
    second = lanes.observe(read_packed_forward(kwargs, processor, known=lanes), step=2)
    assert (second.arrived, second.finished, second.requeued) == ((), ("c",), ("b",))
    assert lanes.get("a").tokens == [1, 2, 3, 4, 5, 6, 50]
    assert [lane.status for lane in lanes] == ["decoding", "waiting", "finished", "waiting"]


def test_a_batch_that_does_not_match_the_slices_is_not_trusted():
    kwargs, processor = _forward()
    processor.requests_in_batch = processor.requests_in_batch[::-1]  # another order than the packed row's
    packed = read_packed_forward(kwargs, processor)
    assert [(r.request_id, r.status) for r in packed.requests] == [
        ("#0", "unknown"),
        ("#1", "unknown"),
        ("#2", "unknown"),
    ]
    assert check_request_positions(packed) == []  # no false position-gap from pairing the wrong requests

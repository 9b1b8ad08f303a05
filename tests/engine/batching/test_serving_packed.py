"""Continuous batching read per request: transformers' own generate_batch on a tiny Llama, every forward read."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import pytest
import torch

from kvtui.engine.batching.checks import (
    check_request_positions,
    position_gap_diagnostic,
    recomputed_prefix_diagnostic,
)
from kvtui.engine.batching.lanes import FINISHED, LaneChanges, RequestLanes
from kvtui.engine.batching.packed import (
    DECODE,
    PREFILL,
    PackedForward,
    find_batch_processor,
    is_packed_forward,
    read_packed_forward,
)

try:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
except ImportError:  # 4.57: continuous batching sizes its cache from accelerator memory, it does not run on CPU
    ContinuousBatchingConfig = None

SYSTEM = {"role": "system", "content": "You are a helpful assistant who answers briefly and politely."}
QUESTIONS = ["What is a cache?", "Why do positions matter?", "Name a color.", "Count to three."]
NEW_TOKENS = 3


@dataclass
class Run:
    """What one generate_batch did, as read at each forward."""

    prompts: dict[str, list[int]]
    outputs: dict[str, list[int]]
    forwards: list[PackedForward] = field(default_factory=list)
    changes: list[LaneChanges] = field(default_factory=list)
    planted: list[tuple[str, int, PackedForward]] = field(default_factory=list)  # (request, token, its reading)
    lanes: RequestLanes = field(default_factory=RequestLanes)
    prefix_sharing: bool = False


def _prompts(tokenizer) -> list[list[int]]:
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [SYSTEM, {"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
        for q in QUESTIONS
    ]
    prompts[2][0] = prompts[2][0] + 1  # one prompt starts differently: it shares no prefix with the others
    return prompts


def _plant(kwargs: dict, packed: PackedForward, processor, run: Run) -> None:
    """A hand-edited copy of the forward's arguments: one position of its second request moved by 5."""
    if len(packed.requests) < 2:
        return
    request = packed.requests[1]
    token = 1 if request.n > 1 else 0
    edited = dict(kwargs)
    edited["position_ids"] = kwargs["position_ids"].clone()
    edited["position_ids"][0, request.start + token] += 5
    run.planted.append((request.request_id, token, read_packed_forward(edited, processor)))


def _generate(tiny_dir, monkeypatch, *, sharing: bool) -> Run:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path = tiny_dir("llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")  # 5.24: CB-ready
    prompts = _prompts(tokenizer)
    run = Run(prompts={}, outputs={})
    original = type(model).__call__

    def watched(self, *args, **kwargs):
        assert is_packed_forward(kwargs)
        processor = find_batch_processor(sys._getframe(1))
        assert processor is not None
        packed = read_packed_forward(kwargs, processor, known=run.lanes)
        run.forwards.append(packed)
        run.changes.append(run.lanes.observe(packed, len(run.forwards)))
        _plant(kwargs, packed, processor, run)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "__call__", watched)
    # small blocks and a small token budget: prefills split and spread over forwards, so prefixes can be shared
    config = ContinuousBatchingConfig(page_size=16, max_batch_tokens=80, num_blocks=64, allow_block_sharing=sharing)
    outputs = model.generate_batch(
        inputs=prompts,
        generation_config=GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False),
        continuous_batching_config=config,
    )
    monkeypatch.undo()
    run.outputs = {rid: list(out.generated_tokens) for rid, out in outputs.items()}
    run.prompts = {rid: list(out.prompt_ids) for rid, out in outputs.items()}
    run.prefix_sharing = run.forwards[0].prefix_sharing
    return run


@pytest.fixture(scope="module")
def runs(tiny_dir):
    if ContinuousBatchingConfig is None:
        pytest.skip("continuous batching runs on CPU from transformers 5.x (4.57 sizes its cache from GPU memory)")
    made: dict[bool, Run] = {}

    def make(sharing: bool) -> Run:
        if sharing not in made:
            with pytest.MonkeyPatch.context() as monkeypatch:
                made[sharing] = _generate(tiny_dir, monkeypatch, sharing=sharing)
        return made[sharing]

    return make


def test_a_plain_forward_is_not_packed():
    from transformers import DynamicCache

    assert not is_packed_forward({"input_ids": torch.tensor([[1, 2]]), "past_key_values": DynamicCache()})
    assert not is_packed_forward({"cu_seq_lens_q": torch.tensor([0, 2]), "cache": DynamicCache()})
    assert find_batch_processor(sys._getframe()) is None


@pytest.mark.parametrize("sharing", [True, False])
def test_every_request_is_found_with_its_tokens_and_positions(runs, sharing):
    run = runs(sharing)
    assert len(run.forwards) > 2 and max(len(f.requests) for f in run.forwards) > 1  # really packed
    fed: dict[str, list[int]] = {rid: [] for rid in run.outputs}
    held: dict[str, int] = {}
    for packed in run.forwards:
        assert packed.layout == "allocators"
        assert [r.start for r in packed.requests] == [0] + [r.end for r in packed.requests[:-1]]
        for request in packed.requests:
            assert request.n == request.planned
            assert request.positions == tuple(range(request.held_before, request.held_after))
            if request.request_id in held:  # each forward continues where the last one left that request
                assert request.held_before == held[request.request_id]
            elif request.held_before:  # a prefix hit: the first forward starts past the shared blocks
                fed[request.request_id] += run.prompts[request.request_id][: request.held_before]
            held[request.request_id] = request.held_after
            fed[request.request_id] += request.fed_ids
    for rid, prompt in run.prompts.items():
        # every prompt token, then every generated token but the last (sampled by the last forward)
        assert fed[rid] == prompt + run.outputs[rid][:-1]
    phases = {r.phase for f in run.forwards for r in f.requests}
    assert DECODE in phases and len(phases) >= 2
    assert PREFILL in phases or any(r.held_before for f in run.forwards for r in f.requests if r.phase != DECODE)


@pytest.mark.parametrize("sharing", [True, False])
def test_positions_check_clean_on_a_correct_run(runs, sharing):
    run = runs(sharing)
    assert [check_request_positions(packed) for packed in run.forwards] == [[] for _ in run.forwards]


def test_a_planted_wrong_position_is_named(runs):
    run = runs(True)
    assert run.planted
    for request_id, token, packed in run.planted:
        findings = check_request_positions(packed)
        assert [(f.request_id, f.token, f.offset) for f in findings] == [(request_id, token, 5)]
        diagnostic = position_gap_diagnostic(findings[0], step=7, at=" (at prog.py:3)")
        assert (diagnostic.code, diagnostic.severity, diagnostic.step) == ("position-gap", "error", 7)
        assert f"request {request_id} token {token} " in diagnostic.message
        assert diagnostic.message.endswith(" (at prog.py:3)")


def test_block_tables_and_shared_blocks_are_read(runs):
    run = runs(True)
    assert run.prefix_sharing  # allow_block_sharing (the default) on a full-attention model
    last = run.forwards[-1]
    (group,) = last.groups
    assert (group.name, group.layers, group.block_tokens) == ("full_attention", (0, 1), 16)
    assert group.used + group.free + group.cached <= group.total
    for packed in run.forwards:
        for request in packed.requests:
            (blocks,) = request.blocks
            # a block table covers every token the request holds after this forward
            assert len(blocks.blocks) * 16 >= request.held_after
    shared = [r for f in run.forwards for r in f.requests if r.shared_blocks]
    assert shared and any(f.groups[0].shared for f in run.forwards)
    hits = [lane for lane in run.lanes if lane.prefix_hit]
    assert hits, "no request reused a prefix"
    for lane in hits:
        assert lane.prefix_hit % 16 == 0
        first = next(r for f in run.forwards for r in f.requests if r.request_id == lane.request_id)
        hit_blocks = first.blocks[0]
        assert all(refs > 1 for refs in hit_blocks.refs[: lane.prefix_hit // 16])  # the shared prefix blocks
    different = next(rid for rid, prompt in run.prompts.items() if prompt[0] != run.prompts["req_0"][0])
    assert run.lanes.get(different).prefix_hit == 0


def _common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_prefix_match_is_no_miss(runs):
    """With prefix sharing on, a request that got its prefix from the ledger recomputed only the partial block
    after it: no recomputed-prefix (a miss would need whole blocks the ledger could have shared)."""
    run = runs(True)
    hits = {lane.request_id for lane in run.lanes if lane.prefix_hit}
    misses = [m for c in run.changes for m in c.misses]
    assert hits and not hits & {m.request_id for m in misses}
    assert all(m.reusable > 0 for m in misses)


def test_a_prefix_miss_is_named_at_its_token(runs, tiny_dir):
    from transformers import AutoTokenizer

    sharing = False
    run = runs(sharing)
    misses = [m for c in run.changes for m in c.misses]
    assert misses
    shared_chain = _common(run.prompts["req_0"], run.prompts["req_1"])  # system prompt and the user turn's start
    different = next(rid for rid, prompt in run.prompts.items() if prompt[0] != run.prompts["req_0"][0])
    assert different not in {m.request_id for m in misses}
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir("llama"))
    for miss in misses:
        prompt = run.prompts[miss.request_id]
        assert miss.holder != miss.request_id
        assert miss.differs_at == _common(prompt, run.prompts[miss.holder]) == shared_chain
        assert miss.token == prompt[miss.differs_at]
        assert miss.first + miss.count <= shared_chain
        text = tokenizer.decode([miss.token])
        diagnostic = recomputed_prefix_diagnostic(miss, step=3, prefix_sharing=run.prefix_sharing, token_text=text)
        assert diagnostic.code == "recomputed-prefix"
        assert f"request {miss.request_id} re-encoded {miss.count} tokens that request {miss.holder}" in (
            diagnostic.message
        )
        assert f"at token {miss.differs_at} ({text})" in diagnostic.message
        assert "prefix sharing is off" in diagnostic.message
    # every request sharing the chain but the first one fed re-encodes what it held
    first = next(r.request_id for r in run.forwards[0].requests if r.request_id != different)
    assert {m.request_id for m in misses} == set(run.prompts) - {first, different}


def test_lanes_arrive_and_finish(runs):
    run = runs(True)
    arrived = [rid for c in run.changes for rid in c.arrived]
    assert sorted(arrived) == sorted(run.outputs)  # each once
    finished = [rid for c in run.changes for rid in c.finished]
    assert finished and len(set(finished)) == len(finished)
    for lane in run.lanes:
        assert lane.forwards > 0
        assert lane.held == len(lane.tokens)  # its buffer: every token its cache holds, in order
        prompt = run.prompts[lane.request_id]
        assert lane.tokens == prompt + run.outputs[lane.request_id][: len(lane.tokens) - len(prompt)]
        assert (lane.status == FINISHED) == (lane.request_id in finished)
        assert lane.finished or lane.status == "decoding"  # the last forward decoded the ones still live

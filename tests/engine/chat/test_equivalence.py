"""Cached incremental decoding over a 3-turn chat equals a full no-cache forward, for every architecture,
and every number a snapshot reports matches the cache and the model computed independently."""

import pytest
import torch

from kvtui.engine import ChatSession, SessionConfig

TURNS = [
    "Let's start by defining a variable k equal to 5. What is k?",
    "Now multiply k by 3. What is k?",
    "What is the capital of France?",
]

ARCHES = [
    ("llama", {"bos": True, "eos": True}),  # post-processor adds BOS and EOS (unused by the template path)
    ("qwen2", {}),
    ("qwen3", {}),
    ("mistral", {"sliding_window": 8}),  # the chat passes the window: sliding layers evict
    ("gemma3", {"sliding_window": 8}),  # sliding + full layers
    ("gpt2", {}),  # learned absolute positions
]


def template_ids(tokenizer, messages):
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return list(ids[0]) if ids and isinstance(ids[0], list) else list(ids)


def check_step(session, snapshot, model):
    ids = torch.tensor([[t.id for t in snapshot.buffer]])  # [1, n]
    with torch.inference_mode():
        full = model(input_ids=ids, use_cache=False).logits[0, -1].float()  # default positions 0..n-1
    assert torch.allclose(session.last_logits, full, atol=1e-5), (session.last_logits - full).abs().max()
    # the chosen (greedy) token and the reported top-k come from the same distribution
    assert snapshot.chosen.id == int(full.argmax())
    top = torch.topk(torch.softmax(full, -1), 3)
    assert [t.id for t in snapshot.topk[:3]] == top.indices.tolist()
    assert [t.prob for t in snapshot.topk[:3]] == pytest.approx(top.values.tolist(), abs=1e-5)
    # cursor, cache length and buffer agree with the cache itself
    cache_len = int(session.cache.get_seq_length())
    assert snapshot.cursor == snapshot.cache_seq_length == len(snapshot.buffer) == cache_len
    assert [t.position for t in snapshot.buffer] == list(range(cache_len))
    # per-layer shapes, bytes and fill are the cache's own
    window = getattr(model.config, "sliding_window", None)
    for info, layer in zip(snapshot.layers, session.cache.layers, strict=True):
        assert info.k_shape == tuple(layer.keys.shape)
        assert info.v_shape == tuple(layer.values.shape)
        assert info.bytes == layer.keys.untyped_storage().nbytes() + layer.values.untyped_storage().nbytes()
        if info.kind == "sliding":
            assert info.filled == min(cache_len, window - 1) == layer.keys.shape[-2]
            assert info.held_from == cache_len - info.filled
        else:
            assert info.kind == "full" and info.filled == cache_len and info.held_from == 0


@pytest.mark.parametrize("arch,kwargs", ARCHES, ids=[a for a, _ in ARCHES])
def test_three_turn_chat_matches_full_forward(tiny_model, arch, kwargs):
    model, tokenizer = tiny_model(arch, **kwargs)
    session = ChatSession(model, tokenizer, SessionConfig(max_new_tokens=6))
    steps = 0
    for turn in TURNS:
        snapshot = session.send(turn)
        assert snapshot.phase == "prefill"
        # after the prefill the cache holds exactly what the template renders for the chat so far
        assert snapshot.buffer.ids() == template_ids(tokenizer, session.messages[:-1])
        check_step(session, snapshot, model)
        while not session.turn_done:
            snapshot = session.step()
            assert snapshot.phase == "decode" and len(snapshot.input_ids) == 1
            check_step(session, snapshot, model)
            steps += 1
    assert steps >= 10
    # random weights babble bytes that re-encode differently: template-drift is the truthful warning then
    assert {d.code for d in session.diagnostics} <= {"template-drift", "sliding-eviction"}, session.diagnostics
    if arch in ("mistral", "gemma3"):
        assert any(d.code == "sliding-eviction" for d in session.diagnostics)
        assert any(layer.held_from > 0 for layer in session.last.layers)
    assert session.verify().ok


@pytest.mark.parametrize("arch,kwargs", [ARCHES[0], ARCHES[3], ARCHES[5]], ids=["llama", "mistral", "gpt2"])
def test_no_cache_session_is_the_full_forward_and_matches_cached_decoding(tiny_model, arch, kwargs):
    """--cache none: no cache object, every step one forward over the whole context. Its logits are the full
    recompute's, its greedy tokens are the dynamic cache's, and every snapshot says it holds no layers."""
    model, tokenizer = tiny_model(arch, **kwargs)
    runs = {}
    for cache in ("none", "dynamic"):
        session = ChatSession(model, tokenizer, SessionConfig(cache=cache, max_new_tokens=6))
        snaps = []
        for turn in TURNS:
            snaps.append(session.send(turn))
            session.generate(on_step=snaps.append)
        runs[cache] = (session, snaps)
    session, snaps = runs["none"]
    assert session.cache is None and session.cache_length == 0
    assert session.buffer.ids() == runs["dynamic"][0].buffer.ids()  # the same greedy chat
    for snap, cached in zip(snaps, runs["dynamic"][1], strict=True):
        assert snap.uncached and snap.layers == () and snap.cache_seq_length == 0 and snap.capacity is None
        # every step fed the whole context: the step's buffer is what the model read, at positions 0..n-1
        assert [t.position for t in snap.buffer] == list(range(len(snap.buffer))) and snap.cursor == len(snap.buffer)
        assert snap.chosen.id == cached.chosen.id
        assert [t.prob for t in snap.topk[:3]] == pytest.approx([t.prob for t in cached.topk[:3]], abs=1e-5)
    ids = torch.tensor([session.buffer.ids()])
    with torch.inference_mode():
        full = model(input_ids=ids, use_cache=False).logits[0, -1].float()
    assert torch.allclose(session.last_logits, full, atol=1e-6)
    assert not any(d.code == "cursor-mismatch" for d in session.diagnostics)
    assert session.verify().ok and session.verify().max_abs_diff < 1e-5
    # rewinds work on the token list alone; the trace record says the step was uncached and replay reads it back
    before = session.buffer.ids()
    rewound = session.rewind(3)
    assert session.buffer.ids() == before[:-3] and rewound.uncached and len(rewound.buffer) == len(before) - 3
    with torch.inference_mode():
        full = model(input_ids=torch.tensor([before[:-3]]), use_cache=False).logits[0, -1].float()
    assert torch.allclose(session.last_logits, full, atol=1e-6)
    from kvtui.engine.records.codec import from_record, to_record
    from kvtui.engine.records.snapshot import StepSnapshot

    again = from_record(StepSnapshot, to_record(session.last), buffer=session.last.buffer)
    assert again.uncached and again.layers == ()

"""--attention in kvtui's own chat: every layer's newest-query attention, the model left on its own attention
implementation (sdpa), checked against eager attention's `output_attentions` over the buffer's tokens."""

import torch
from transformers import AutoModelForCausalLM

from kvtui.engine import ChatSession, SessionConfig
from kvtui.engine.chat.loader import load_model
from kvtui.engine.reading import attention as capture_module


def eager_rows(directory, ids):
    eager = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    with torch.inference_mode():
        return [a[0, :, -1, :].mean(0) for a in eager(input_ids=ids, output_attentions=True).attentions]


def test_every_layer_matches_eager_without_switching_the_model(tiny_dir):
    for arch, kwargs in (("llama", {}), ("mistral", {"sliding_window": 8})):
        directory = tiny_dir(arch, **kwargs)
        loaded = load_model(str(directory), dtype="float32", device="cpu")
        assert loaded.model.config._attn_implementation == "sdpa"  # --attention no longer loads eager
        session = ChatSession(loaded.model, loaded.tokenizer, SessionConfig(max_new_tokens=3, attention=True))
        session.attention_layer = 0
        session.send("What is k?")
        snapshot = session.step()
        assert loaded.model.config._attn_implementation == "sdpa"
        n = len(snapshot.buffer)
        references = eager_rows(directory, torch.tensor([snapshot.buffer.ids()]))
        assert len(snapshot.attention) == len(references) == loaded.model.config.num_hidden_layers
        for entries, reference in zip(snapshot.attention, references):
            assert len(entries) >= min(8, n)
            for position, weight in entries:
                assert abs(reference[position].item() - weight) < 1e-4
            assert abs(reference.topk(8).values[-1].item() - entries[7][1]) < 1e-4
        assert snapshot.attention_layer == 0 and snapshot.attention_detail.layer == 0
        heads = snapshot.attention_detail.heads
        assert len(heads) == loaded.model.config.num_attention_heads
        if arch == "mistral":  # a sliding layer's query sees its window: the W-1 it kept and itself
            assert all(p >= n - 8 for entries in snapshot.attention for p, _ in entries)
        session.close_attention()
        assert not capture_module.patched()


def test_attention_is_off_by_default(tiny_model):
    model, tok = tiny_model("qwen2")
    session = ChatSession(model, tok, SessionConfig(max_new_tokens=2))
    assert session.send("What is k?").attention is None
    assert not capture_module.patched()


def test_primed_pads_are_seen_attended(tiny_model):
    """--prime-pad writes pads the model attends to: the attention alarm names their share and positions; a
    chat without pads raises nothing from its attention (attention to the first token is normal)."""
    model, tok = tiny_model("llama")
    session = ChatSession(model, tok, SessionConfig(max_new_tokens=2, attention=True, prime_pad=4))
    try:
        snapshot = session.send("What is k?")
        found = [d for d in session.diagnostics if d.code == "attended-pads"]
        assert found and "positions 0–3" in found[0].message and "%" in found[0].message
        share = snapshot.attention_detail.shares
        column = snapshot.attention_detail.regions.index("pad")
        mean = sum(row[column] for row in share) / len(share)
        assert f"{mean:.0%} of its attention" in found[0].message
    finally:
        session.close_attention()
    clean = ChatSession(model, tok, SessionConfig(max_new_tokens=3, attention=True))
    try:
        clean.send("What is k?")
        clean.step()
        assert not [d for d in clean.diagnostics if d.code == "attended-pads"]
    finally:
        clean.close_attention()


def test_region_shares_equal_eager_sums_over_their_tokens(tiny_dir):
    """The strip's numbers: each region's share is the head-mean weight on its tokens (eager's `output_attentions`
    summed over the region's positions, independently of kvtui's regions code), and the turns do not overlap the
    system prompt (a first turn's share is its own tokens', not the whole buffer)."""
    directory = tiny_dir("llama")
    loaded = load_model(str(directory), dtype="float32", device="cpu")
    config = SessionConfig(max_new_tokens=2, attention=True, system="You are terse.")
    session = ChatSession(loaded.model, loaded.tokenizer, config)
    try:
        for message in ("What is k?", "And j?"):
            session.send(message)
            snapshot = session.step()
            buffer = snapshot.buffer
            references = eager_rows(directory, torch.tensor([buffer.ids()]))
            detail = snapshot.attention_detail
            user_seen, system, turns = False, [], {}
            for position, token in enumerate(buffer):
                user_seen = user_seen or token.origin == "user"
                if token.origin == "system" or (token.origin == "template" and not user_seen):
                    system.append(position)
                else:
                    turns.setdefault(token.turn, []).append(position)
            expected = {"sink": [0], "system": system}
            for number, positions in turns.items():
                expected["this turn" if number == snapshot.turn else f"turn {number}"] = positions
            assert system and not set(system) & {p for positions in turns.values() for p in positions}
            for name, positions in expected.items():
                column = detail.regions.index(name)
                for layer, reference in enumerate(references):
                    share = reference[positions].sum().item()
                    assert abs(detail.shares[layer][column] - share) < 1e-4, (name, layer)
            assert detail.shares[0][detail.regions.index("this turn")] < 1  # the system prompt is looked at too
    finally:
        session.close_attention()

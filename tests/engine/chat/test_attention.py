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


def test_regions_partition_the_positions_and_add_to_one(tiny_dir):
    """The strip's numbers on a two-turn chat with a system prompt: the regions are a partition of the buffer's
    positions (sink > special > last 16 > system > its turn), computed here from eager attention's
    `output_attentions` (a full forward, no cache), the tokenizer's special ids, each turn's first position (its
    prefill's) and the system prompt's tokens: every row equals eager's weight summed over its positions, and
    each layer's rows add to 1 (the turns before this one have rows too)."""
    directory = tiny_dir("llama")
    loaded = load_model(str(directory), dtype="float32", device="cpu")
    config = SessionConfig(max_new_tokens=3, attention=True, system="You are terse and exact.")
    session = ChatSession(loaded.model, loaded.tokenizer, config)
    tokenizer = loaded.tokenizer  # special: its special tokens and the added tokens marked special (<|start|>)
    special = set(tokenizer.all_special_ids) | {i for i, a in tokenizer.added_tokens_decoder.items() if a.special}
    messages = ("What is k? It is the key of a token in the cache.", "And what is v? Say it in a few words please.")
    starts = []  # each turn's first position: where its prefill wrote
    try:
        for message in messages:
            starts.append(session.send(message).positions[0])
            snapshot = session.step()
            buffer = snapshot.buffer
            ids, total = buffer.ids(), len(buffer)
            references = eager_rows(directory, torch.tensor([ids]))
            user_seen, system = False, set()
            for position, token in enumerate(buffer):  # the system prompt: its tokens, and the template's before
                user_seen = user_seen or token.origin == "user"  # the first user token
                if token.origin == "system" or (token.origin == "template" and not user_seen):
                    system.add(position)
            expected: dict[str, list[int]] = {}
            for position in range(total):
                if position == 0:
                    name = "sink"
                elif ids[position] in special:
                    name = "special"
                elif position >= total - 16:
                    name = "last 16"
                elif position in system:
                    name = "system"
                else:
                    number = max(i + 1 for i, start in enumerate(starts) if start <= position)
                    name = "this turn" if number == len(starts) else f"turn {number}"
                expected.setdefault(name, []).append(position)
            detail = snapshot.attention_detail
            assert set(detail.regions) == set(expected), (detail.regions, sorted(expected))
            assert {"sink", "special", "system", "last 16"} <= set(expected)
            if len(starts) == 2:
                assert {"turn 1", "this turn"} <= set(expected)  # the earlier turn is a row of its own
            for layer, reference in enumerate(references):
                row = detail.shares[layer]
                assert abs(sum(row) - 1) < 1e-5, (layer, sum(row))
                for name, positions in expected.items():
                    share = reference[positions].sum().item()
                    assert abs(row[detail.regions.index(name)] - share) < 1e-4, (name, layer)
    finally:
        session.close_attention()

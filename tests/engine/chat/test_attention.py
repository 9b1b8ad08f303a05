"""--attention: the newest query's attention over the cache, checked against a full forward."""

import torch

from kvtui.engine import ChatSession, SessionConfig
from kvtui.engine.chat.loader import load_model


def test_newest_token_attention_matches_a_full_forward(tiny_dir):
    for arch, kwargs in (("llama", {}), ("mistral", {"sliding_window": 8})):
        loaded = load_model(str(tiny_dir(arch, **kwargs)), dtype="float32", device="cpu", attn_implementation="eager")
        session = ChatSession(loaded.model, loaded.tokenizer, SessionConfig(max_new_tokens=3, attention=True))
        session.attention_layer = 1
        session.send("What is k?")
        snapshot = session.step()
        assert snapshot.attention_layer == 1 and len(snapshot.attention) == len(snapshot.buffer)
        ids = torch.tensor([snapshot.buffer.ids()])
        with torch.inference_mode():
            full = loaded.model(input_ids=ids, output_attentions=True).attentions[1][0, :, -1, :].mean(0)
        assert torch.allclose(torch.tensor(snapshot.attention), full, atol=1e-5)
        assert abs(sum(snapshot.attention) - 1.0) < 1e-4
        if arch == "mistral":  # a sliding layer's query sees its window: the W-1 it kept and itself
            held_from = snapshot.layers[1].held_from  # after this step it keeps W-1, so one more just dropped out
            assert held_from > 1 and all(w == 0.0 for w in snapshot.attention[: held_from - 1])
            assert sum(1 for w in snapshot.attention if w > 0) == 8


def test_attention_is_off_by_default(tiny_model):
    model, tok = tiny_model("qwen2")
    session = ChatSession(model, tok, SessionConfig(max_new_tokens=2))
    assert session.send("What is k?").attention is None

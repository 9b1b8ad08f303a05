"""Every diagnostic is raised by a real scenario, and a clean run raises none."""

import pytest
import torch

from kvtui.engine import CacheOverflowError, ChatSession, SessionConfig, SessionError
from kvtui.engine.records.replay import transcript

DRIFT_TEMPLATE = (  # like templates that stamp the date or a counter into the system header: earlier turns re-render
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if loop.first %}[{{ messages|length }} messages] {% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def codes(session):
    return [d.code for d in session.diagnostics]


def reply_with(session, tokenizer, text):
    """Make the assistant say `text` (forced tokens), then end the turn with the end-of-turn token."""
    for token_id in tokenizer(text, add_special_tokens=False)["input_ids"]:
        session.force(token_id)
        session.step()
    session.force(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    assert session.turn_done


def test_clean_chat_raises_nothing(tiny_model):
    model, tok = tiny_model("qwen2")
    session = ChatSession(model, tok, SessionConfig(max_new_tokens=20))
    for question, answer in [
        ("What is k?", "The variable k is equal to 5."),
        ("Now multiply k by 3.", "k multiplied by 3 is equal to 15."),
        ("Hello!", "How can I help you?"),
    ]:
        session.send(question)
        reply_with(session, tok, answer)
        assert session.cursor == session.cache_length
    assert session.verify().ok
    assert session.diagnostics == []
    assert [m["content"] for m in session.messages if m["role"] == "assistant"][-1] == "How can I help you?"


def test_tokenizer_appended_eos_is_named_862_to_863(tiny_model):
    model, tok = tiny_model("llama", bos=True, eos=True)
    prompt = "The variable k is equal to 5."
    session = ChatSession(model, tok, SessionConfig(mode="completion", max_new_tokens=2))
    snapshot = session.send(prompt)
    bare = tok(prompt, add_special_tokens=False)["input_ids"]
    assert snapshot.cache_seq_length == len(bare) + 2  # BOS in front, EOS behind: what tokenizer(prompt) does
    buffer = list(snapshot.buffer)
    assert (buffer[0].origin, buffer[0].id) == ("tokenizer-added", tok.bos_token_id)
    assert (buffer[-1].origin, buffer[-1].id) == ("tokenizer-added", tok.eos_token_id)
    added = [d for d in snapshot.diagnostics if d.code == "tokenizer-added-special"]
    assert added and added[0].severity == "warning" and "position 0" in added[0].message
    assert "eos-in-context" in [d.code for d in snapshot.diagnostics]


def test_text_tokenization_of_a_chat_adds_specials(tiny_model):
    model, tok = tiny_model("llama", bos=True, eos=True)
    clean = ChatSession(model, tok, SessionConfig(max_new_tokens=2))
    clean.send("What is k?")
    assert codes(clean) == []
    naive = ChatSession(model, tok, SessionConfig(max_new_tokens=2, chat_tokenize="text"))
    naive.send("What is k?")
    assert "tokenizer-added-special" in codes(naive) and "eos-in-context" in codes(naive)
    assert naive.cache_length == clean.cache_length + 2


def test_double_bos_when_template_writes_bos_and_tokenizer_adds_one(tiny_model):
    model, tok = tiny_model("gemma3", bos=True)
    naive = ChatSession(model, tok, SessionConfig(max_new_tokens=2, chat_tokenize="text"))
    naive.send("What is k?")
    assert "double-bos" in codes(naive)
    assert [t.id for t in list(naive.buffer)[:2]] == [tok.bos_token_id] * 2
    clean = ChatSession(model, tok, SessionConfig(max_new_tokens=2))
    clean.send("What is k?")
    assert "double-bos" not in codes(clean)


def test_primed_pad_cache_shows_its_damage(tiny_model):
    model, tok = tiny_model("qwen2")
    session = ChatSession(model, tok, SessionConfig(max_new_tokens=3, prime_pad=4))
    snapshot = session.send("What is k?")
    found = codes(session)
    for code in ("pad-in-cache", "position-gap", "cursor-mismatch"):
        assert code in found, found
    assert snapshot.cache_seq_length == snapshot.cursor + 4
    assert [t.origin for t in list(snapshot.buffer)[:4]] == ["primed"] * 4
    result = session.verify()  # a clean forward of the same tokens disagrees: the pads shifted every position
    assert not result.ok and "cache-mismatch" in codes(session)


def test_template_that_rerenders_earlier_turns_is_caught(tiny_dir):
    from kvtui.engine.chat.loader import load_model

    loaded = load_model(str(tiny_dir("qwen2", template=DRIFT_TEMPLATE)), dtype="float32", device="cpu")
    session = ChatSession(loaded.model, loaded.tokenizer, SessionConfig(max_new_tokens=3))
    session.send("What is k?")
    session.generate()
    assert "template-drift" not in codes(session)
    snapshot = session.send("And m?")
    drift = [d for d in snapshot.diagnostics if d.code == "template-drift"]
    assert drift and "at index" in drift[0].message
    # after rewinding to the common prefix, the cache is exactly the new rendering
    ids = loaded.tokenizer.apply_chat_template(session.messages[:-1], tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert snapshot.buffer.ids() == list(ids)
    assert session.verify().ok


def test_static_cache_warns_then_refuses_overflow_and_recovers(tiny_model):
    model, tok = tiny_model("qwen2")
    probe = ChatSession(model, tok, SessionConfig(max_new_tokens=1))
    prompt_len = probe.send("What is k?").cache_seq_length
    capacity = prompt_len + 4
    session = ChatSession(model, tok, SessionConfig(cache="static", max_cache_len=capacity, max_new_tokens=50))
    session.send("What is k?")
    for _ in range(4):
        session.step()
    assert session.cache_length == capacity
    assert "static-capacity" in codes(session)
    warning = next(d for d in session.diagnostics if d.code == "static-capacity")
    assert warning.severity == "warning"
    with pytest.raises(CacheOverflowError) as refused:
        session.step()
    message = str(refused.value)
    assert f"capacity {capacity}" in message and f"used {capacity}" in message and "requested 1" in message
    assert session.diagnostics[-1].severity == "error" and session.diagnostics[-1].code == "static-capacity"
    assert session.cache_length == capacity  # nothing was written
    # the session goes on after a rewind
    session.rewind(3)
    assert session.cursor == session.cache_length == capacity - 3
    session.step()
    assert session.verify().ok
    assert session.cache_length == capacity - 2
    # a message too long for what is left is refused before any forward: no turn began (it counted one)
    with pytest.raises(CacheOverflowError):
        session.send("And m? " * 20)
    assert session.turn == 1 and [m["role"] for m in session.messages] == ["user", "assistant"]


def test_sliding_eviction_is_reported_and_rewind_past_the_window_recomputes(tiny_model):
    model, tok = tiny_model("mistral", sliding_window=8)
    session = ChatSession(model, tok, SessionConfig(max_new_tokens=4))
    snapshot = session.send("What is k?")
    eviction = [d for d in snapshot.diagnostics if d.code == "sliding-eviction"]
    assert eviction and eviction[0].severity == "info"
    assert all(layer.filled == 7 and layer.held_from == snapshot.cache_seq_length - 7 for layer in snapshot.layers)
    assert eviction[0].message.endswith("no layer holds them any more (every layer is sliding)")  # no full layer
    session.generate()
    before = session.cache_length
    session.rewind(5)  # states the sliding layers dropped are needed again: recomputed, and said so
    assert session.cache_length == before - 5 == session.cursor
    assert any("recomputing" in d.message for d in session.diagnostics)
    assert session.verify().ok


def test_sliding_eviction_beside_full_layers_says_they_still_hold_everything(tiny_model):
    model, tok = tiny_model("gemma2", sliding_window=8)
    snapshot = ChatSession(model, tok, SessionConfig(max_new_tokens=2)).send("What is k?")
    (eviction,) = [d for d in snapshot.diagnostics if d.code == "sliding-eviction"]
    kinds = [layer.kind for layer in snapshot.layers]
    assert "full" in kinds and any("sliding" in kind for kind in kinds)
    assert f"1 of {len(kinds)} layers" in eviction.message
    assert eviction.message.endswith(f"the other layers still hold all {snapshot.cache_seq_length}")


def test_verify_catches_a_cache_modified_behind_the_sessions_back(tiny_model):
    model, tok = tiny_model("qwen2")
    session = ChatSession(model, tok, SessionConfig(max_new_tokens=3))
    session.send("What is k?")
    session.generate()
    assert session.verify().ok
    with torch.inference_mode():
        session.cache.layers[0].keys[:, :, 2, :] += 1.0  # what an in-place update from a stray forward does
    session.rewind(1)  # re-feeds the last token through the corrupted cache
    result = session.verify()
    assert not result.ok and result.max_abs_diff > result.tolerance
    assert session.diagnostics[-1].code == "cache-mismatch"


def test_force_feeds_the_chosen_alternative(tiny_model):
    model, tok = tiny_model("qwen2")
    session = ChatSession(model, tok, SessionConfig(max_new_tokens=5))
    snapshot = session.send("What is k?")
    alternative = snapshot.topk[3]
    forced = session.force(alternative.id)
    assert forced.id == alternative.id and forced.rank == 4 and session.pending_forced
    after = session.step()
    last = list(after.buffer)[-1]
    assert (last.id, last.origin) == (alternative.id, "forced")
    assert after.input_ids == (alternative.id,)
    with pytest.raises(SessionError):
        session.force(10**9)


def test_rewind_into_an_earlier_turn_then_chat_again(tiny_model):
    model, tok = tiny_model("qwen2")
    session = ChatSession(model, tok, SessionConfig(max_new_tokens=3))
    first = session.send("What is k?")
    session.generate()
    session.send("And m?")
    session.generate()
    session.rewind_to(len(first.buffer))  # back to the end of the first prefill
    assert session.cache_length == len(first.buffer) == session.cursor
    assert [m["role"] for m in session.messages] == ["user", "assistant"]
    assert session.turn == 1  # back in the first turn (it said 2, and tagged the tokens fed next turn 2)
    session.generate()
    assert {t.turn for t in session.buffer} == {1}
    # the chat a replay rebuilds from the buffer is the session's own: one reply, not split at the rewind
    assert [m["role"] for m in transcript(session.buffer)] == [m["role"] for m in session.messages]
    session.send("Hello!")
    assert session.turn == 2 and session.buffer[-1].turn == 2
    assert session.verify().ok
    assert session.cursor == session.cache_length
    with pytest.raises(SessionError):
        session.rewind(10**6)


def test_static_cache_chat_matches_full_forward(tiny_model):
    for arch in ("llama", "gemma3"):
        model, tok = tiny_model(arch, **({"sliding_window": 8} if arch == "gemma3" else {}))
        session = ChatSession(model, tok, SessionConfig(cache="static", max_cache_len=256, max_new_tokens=4))
        for turn in ("What is k?", "And m?"):
            session.send(turn)
            while True:
                ids = torch.tensor([session.buffer.ids()])
                with torch.inference_mode():
                    full = model(input_ids=ids, use_cache=False).logits[0, -1]
                assert torch.allclose(session.last_logits, full, atol=1e-5)
                assert session.last.cursor == session.last.cache_seq_length
                assert {layer.kind for layer in session.last.layers} <= {"static", "static-sliding"}
                assert all(layer.capacity and layer.filled <= layer.capacity for layer in session.last.layers)
                if session.turn_done:
                    break
                session.step()
        session.rewind(2)
        assert session.verify().ok


def test_a_model_without_chat_template_gets_a_clear_error_and_completion_mode_works(tiny_dir):
    from kvtui.engine.chat.loader import load_model

    loaded = load_model(str(tiny_dir("qwen2")), dtype="float32", device="cpu")
    loaded.tokenizer.chat_template = None
    with pytest.raises(SessionError, match="no chat template.*--mode completion"):
        ChatSession(loaded.model, loaded.tokenizer, SessionConfig())
    session = ChatSession(loaded.model, loaded.tokenizer, SessionConfig(mode="completion", max_new_tokens=2))
    snapshot = session.send("The variable k is equal to 5.")
    assert snapshot.buffer.ids() == loaded.tokenizer("The variable k is equal to 5.")["input_ids"]

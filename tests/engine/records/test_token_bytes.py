"""A token is bytes: the text of any run of tokens, rebuilt from what the trace carries (no tokenizer), equals
the tokenizer's own decode of the same ids, for texts whose characters are split across tokens, live and
replayed. The truth is `tokenizer.decode`; kvtui's side is its piece cache, its codec and its replay."""

from __future__ import annotations

import json

import pytest

from kvtui.engine import ChatSession, SessionConfig
from kvtui.engine.reading.export import export_cache, load_cache
from kvtui.engine.reading.token_texts import tokenizer_texts
from kvtui.engine.records.diff import token_pieces
from kvtui.engine.records.recorder import Recorder
from kvtui.engine.records.replay import Replay, transcript
from kvtui.engine.records.token_bytes import (
    bytes_record,
    ending_on,
    hex_bytes,
    learn_bytes,
    run_text,
    unfinished_tail,
)
from kvtui.engine.records.trace import read_trace

TEXTS = [
    "你好，世界",  # CJK: three bytes a character
    "👩🏽‍💻 and 👨‍👩‍👧 and 👍🏿",  # emoji with skin-tone modifiers and ZWJ sequences: four-byte pieces
    "café déjà vu, naïve",  # accents: two bytes
    "مرحبا بالعالم",  # Arabic
    "नमस्ते दुनिया",  # Devanagari, with combining signs
    "k = 5 ☕ — done",  # ASCII around a symbol and a dash
]


@pytest.fixture(scope="module")
def tokenizers_under_test(tiny_model):
    """name -> tokenizer: the embedded SmolLM2 (byte-level BPE), a tiny byte-level BPE and a tiny
    SentencePiece-style tokenizer with byte fallback."""
    from transformers import AutoTokenizer

    from kvtui.engine.models.embedded import embedded_model_dir

    return {
        "smollm2": AutoTokenizer.from_pretrained(embedded_model_dir()),
        "tiny-qwen2": tiny_model("qwen2")[1],
        "tiny-llama-byte-fallback": tiny_model("llama", byte_fallback=True)[1],
    }


def _through_a_record(texts, ids: list[int]) -> tuple[list[tuple[int, str]], dict[int, bytes]]:
    """What a trace reader has after a line naming `ids`: each id's piece and the table its "bytes" gave."""
    pieces = [(i, texts.piece(i)) for i in ids]
    line = json.loads(json.dumps({"bytes": bytes_record(ids, texts.token_bytes)}))
    table: dict[int, bytes] = {}
    learn_bytes(line["bytes"], table)
    return pieces, table


@pytest.mark.parametrize("name", ["smollm2", "tiny-qwen2", "tiny-llama-byte-fallback"])
def test_text_rebuilt_from_the_record_equals_decode(tokenizers_under_test, name):
    tok = tokenizers_under_test[name]
    texts = tokenizer_texts(tok)
    split_somewhere = False
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        pieces, table = _through_a_record(texts, ids)
        truth = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert run_text(pieces, table) == truth, (name, text)
        # every run, not only the whole text: a chat pane shows a message, a buffer a window of tokens
        for start in range(len(ids)):
            end = min(len(ids), start + 5)
            part = tok.decode(ids[start:end], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            rebuilt = run_text(pieces[start:end], table)
            if "\ufffd" in part and name.endswith("byte-fallback"):
                # a run cut inside a character: tokenizers' ByteFallback decoder makes every byte of an invalid
                # byte run U+FFFD (whole characters in it too); kvtui marks only the cut ends, as byte-level does
                assert rebuilt.strip("\ufffd") in truth and "\ufffd" not in rebuilt.strip("\ufffd"), (name, start)
                continue
            assert rebuilt == part, (name, text, start)
        split_somewhere |= any("\ufffd" in piece for _, piece in pieces)
    assert split_somewhere, f"{name}: no character was split across tokens, so nothing was tested"


def _record_chat(tok, model, path, prompt: str, reply: str) -> ChatSession:
    """A recorded chat: the prompt sent, then the reply's tokens forced one by one (a random tiny model would
    not write them), through kvtui's one recorder."""
    session = ChatSession(model, tok, SessionConfig(max_new_tokens=64))
    recorder = Recorder(session, path)
    session.send(prompt)
    for token_id in tok(reply, add_special_tokens=False)["input_ids"]:
        session.force(token_id)
        session.step()
    recorder.close()
    return session


@pytest.mark.parametrize("arch, kwargs", [("qwen2", {}), ("llama", {"byte_fallback": True})])
def test_a_replayed_chat_equals_the_live_one_character_for_character(tiny_model, tmp_path, arch, kwargs):
    model, tok = tiny_model(arch, **kwargs)
    path = tmp_path / "chat.jsonl"
    session = _record_chat(tok, model, path, "你好，世界 👩🏽‍💻 café", "再见 👨‍👩‍👧 déjà vu मरहबा")
    live = [{"role": m["role"], "content": m["content"]} for m in session.messages]
    replay = Replay(read_trace(path))
    last = replay.snapshots[-1]
    assert transcript(last.buffer, last.token_bytes) == live
    # the whole buffer too, template markup included: what the cache holds, as the tokenizer reads it
    held = [t.id for t in last.buffer]
    truth = tok.decode(held, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert run_text([(t.id, t.piece) for t in last.buffer], last.token_bytes) == truth
    assert "\ufffd" not in truth
    # the turn-end buffer line carries its own bytes: it reads without the steps
    buffer_line = read_trace(path).buffers[-1]
    table: dict[int, bytes] = {}
    learn_bytes(buffer_line.get("bytes"), table)
    tokens = buffer_line["tokens"]
    assert run_text([(t["id"], t["piece"]) for t in tokens], table) == tok.decode(
        [t["id"] for t in tokens], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    # diff names tokens by their bytes where a piece is no character: never U+FFFD
    named = token_pieces(read_trace(path))
    assert named and not any("\ufffd" in text for text in named.values())
    # an exported cache rebuilds the text it holds the same way
    exported = load_cache(export_cache(session, tmp_path / "cache.safetensors"))
    assert exported.text() == tok.decode(
        exported.token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
    )


@pytest.mark.parametrize("arch, kwargs", [("qwen2", {}), ("llama", {"byte_fallback": True})])
def test_a_reply_seen_inside_a_character_is_the_same_live_and_replayed_and_never_u_fffd(
    tiny_model, tmp_path, arch, kwargs
):
    """At every step of a reply whose characters are split across tokens, the open reply as a pane shows it
    (`ending_on` its `unfinished_tail`) holds no U+FFFD, and the live session's equals its replay's; where the cache
    ends inside a character it ends on that character's first bytes, the decode of everything before them whole."""
    model, tok = tiny_model(arch, **kwargs)
    path = tmp_path / "chat.jsonl"
    session = ChatSession(model, tok, SessionConfig(max_new_tokens=64))
    recorder = Recorder(session, path)
    session.send("Hi")
    live: list[str] = []
    reply = tok("再见 👨‍👩‍👧 déjà", add_special_tokens=False)["input_ids"]
    for token_id in reply:
        session.force(token_id)
        session.step()
        tail = unfinished_tail(session.buffer, session.token_bytes)
        live.append(ending_on(session.messages[-1]["content"], tail))
    recorder.close()
    inside = 0
    replayed = Replay(read_trace(path)).snapshots[1:]  # the steps after the prefill: one per forced token
    assert len(replayed) == len(reply) == len(live)
    for count, (shown, snapshot) in enumerate(zip(live, replayed, strict=True), start=1):
        assert "\ufffd" not in shown, (count, shown)
        tail = unfinished_tail(snapshot.buffer, snapshot.token_bytes)
        assert ending_on(transcript(snapshot.buffer, snapshot.token_bytes)[-1]["content"], tail) == shown, count
        if tail:
            inside += 1
            assert shown.endswith(hex_bytes(tail)), (count, shown)
            # what comes before those bytes is the text as it reads once the character is complete: the tokenizer's
            # own decode of the reply up to the first later step that holds no U+FFFD
            whole = next(
                text
                for text in (
                    tok.decode(reply[:end], clean_up_tokenization_spaces=False) for end in range(count + 1, 99)
                )
                if "\ufffd" not in text
            )
            assert whole.startswith(shown.removesuffix(hex_bytes(tail))), (count, whole, shown)
    assert inside >= 2  # the emoji and CJK pieces stopped the cache inside a character


def test_bytes_are_written_only_where_a_piece_is_not_its_bytes(tiny_model, tmp_path):
    model, tok = tiny_model("qwen2")
    path = tmp_path / "ascii.jsonl"
    _record_chat(tok, model, path, "What is k?", " k is 5.")
    steps = read_trace(path).steps
    forced = {i for s in steps for i in s["input_ids"]}
    # the random model's own top-k may name pieces of characters; the fed ASCII tokens never need bytes
    assert all(not (set(map(int, s.get("bytes", {}))) & forced) for s in steps)
    mixed = tmp_path / "mixed.jsonl"
    _record_chat(tok, model, mixed, "What is 你?", " 好")
    written = {int(i): bytes.fromhex(b) for s in read_trace(mixed).steps for i, b in s.get("bytes", {}).items()}
    pieces = [tok.decode([i]) for i in written]
    assert written and all("\ufffd" in p for p in pieces)  # only pieces of split characters


def test_a_trace_written_before_the_bytes_field_still_reads(tiny_model, tmp_path):
    """An old trace (no "bytes" anywhere) replays as it did: its pieces as recorded."""
    model, tok = tiny_model("qwen2")
    path = tmp_path / "new.jsonl"
    _record_chat(tok, model, path, "你好 k", " ok")
    old = tmp_path / "old.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert any("bytes" in line for line in lines)
    for line in lines:
        line.pop("bytes", None)
    old.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
    replay = Replay(read_trace(old))
    last = replay.snapshots[-1]
    assert dict(last.token_bytes) == {}
    user = transcript(last.buffer, last.token_bytes)[0]["content"]
    assert user == "".join(t.piece for t in last.buffer if t.origin == "user")  # what older kvtui showed
    assert "\ufffd" in user


@pytest.mark.parametrize("arch, kwargs", [("qwen2", {}), ("llama", {"byte_fallback": True})])
def test_a_watched_program_s_trace_rebuilds_its_text(tiny_model, tmp_path, arch, kwargs):
    """A program watched by the probe (its own forwards on its own cache): the text its cache holds, rebuilt from
    the trace, is the tokenizer's decode of the ids it fed."""
    import torch

    from kvtui.engine.watch.probe import watch

    model, tok = tiny_model(arch, **kwargs)
    path = tmp_path / "watched.jsonl"
    ids = tok("你好，世界 👩🏽‍💻 déjà vu", add_special_tokens=False, return_tensors="pt")["input_ids"]
    with watch(model, tok, trace=path), torch.inference_mode():
        model(input_ids=ids, use_cache=True)
    last = Replay(read_trace(path)).snapshots[-1]
    assert last.buffer.ids() == ids[0].tolist()
    truth = tok.decode(ids[0], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert run_text([(t.id, t.piece) for t in last.buffer], last.token_bytes) == truth
    assert any("\ufffd" in t.piece for t in last.buffer)  # split characters: the bytes were needed


def test_a_compare_lane_s_reply_ends_on_the_bytes_of_a_character_not_complete_yet():
    """`kvtui compare` shows each lane's reply from its tokens' bytes: a whole split character once, one cut short
    at the end by its bytes, never U+FFFD (a byte that can never begin a character stays U+FFFD: it is no cut)."""
    from kvtui.compare import Lane

    star = "🌟".encode()  # f0 9f 8c 9f
    lane = Lane("dynamic")
    for cut, shown in [(4, "Hi 🌟"), (1, "Hi ⟨f0⟩"), (3, "Hi ⟨f0 9f 8c⟩")]:
        lane.reply = [b"Hi", b" ", star[:cut]]
        assert lane.reply_text == shown
    lane.reply = [b"Hi ", star, star[:2]]
    assert lane.reply_text == "Hi 🌟⟨f0 9f⟩"
    lane.reply = [b"Hi \x9f"]  # a continuation byte alone: no character was cut, and none can be
    assert lane.reply_text == "Hi \ufffd"

"""Exporting the live cache to safetensors: the filled slots exactly, the buffer, atomic writes."""

import json
import os

import pytest
import torch

from kvtui.engine import ChatSession, SessionConfig
from kvtui.engine.reading.export import SCHEMA, ExportError, export_cache, load_cache, to_dynamic_cache

TURNS = ["Let's start by defining a variable k equal to 5. What is k?", "Now multiply k by 3. What is k?"]
META_KEYS = {"schema", "model_class", "dtype", "step", "cursor", "cache_seq_length", "layers", "tokens", "positions"}
LAYER_KEYS = {"kind", "filled", "seen", "held_from", "window", "capacity"}
TOKEN_KEYS = {"position", "id", "piece", "special", "origin", "turn"}


def chat(model, tokenizer, turns=TURNS, **config):
    session = ChatSession(model, tokenizer, SessionConfig(max_new_tokens=4, **config))
    for turn in turns:
        session.send(turn)
        session.generate()
    return session


def assert_matches_live(export, session):
    """Every exported tensor is the live layer's filled slots; the tokens are the session's buffer."""
    assert len(export.keys) == len(export.values) == len(session.cache.layers) == len(export.layers)
    for info, keys, values, layer in zip(export.layers, export.keys, export.values, session.cache.layers):
        filled = info["filled"]
        assert keys.shape[-2] == values.shape[-2] == filled
        assert keys.is_contiguous() and keys.device.type == "cpu"
        assert torch.equal(keys, layer.keys[:, :, :filled]) and torch.equal(values, layer.values[:, :, :filled])
    assert export.token_ids == session.buffer.ids()
    assert export.positions == [t.position for t in session.buffer]
    meta = export.meta
    assert META_KEYS <= set(meta) and meta["schema"] == SCHEMA
    assert meta["model_class"] == type(session.model).__name__ and meta["dtype"] == "float32"
    assert meta["step"] == session.steps and meta["cursor"] == session.cursor
    assert meta["cache_seq_length"] == session.cache_length == len(session.buffer)
    assert all(LAYER_KEYS <= set(layer) for layer in export.layers)
    assert all(TOKEN_KEYS <= set(token) for token in export.tokens)
    assert [t["piece"] for t in export.tokens] == [t.piece for t in session.buffer]
    assert [t["origin"] for t in export.tokens] == [t.origin for t in session.buffer]


def test_export_after_a_two_turn_llama_chat(tiny_model, tmp_path):
    model, tokenizer = tiny_model("llama")
    session = chat(model, tokenizer)
    path = export_cache(session, tmp_path / "llama.safetensors")
    assert path == tmp_path / "llama.safetensors" and path.is_file()
    assert sorted(os.listdir(tmp_path)) == ["llama.safetensors"]  # no temporary file left
    export = load_cache(path)
    assert_matches_live(export, session)
    assert {layer["kind"] for layer in export.layers} == {"full"}
    assert all(layer["held_from"] == 0 and layer["filled"] == session.cache_length for layer in export.layers)
    assert {t["turn"] for t in export.tokens} == {1, 2}
    # the metadata is plain safetensors metadata: JSON strings other tools can read
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        raw = handle.metadata()
    assert json.loads(raw["schema"]) == SCHEMA and isinstance(json.loads(raw["tokens"]), list)


def test_export_of_sliding_layers_past_the_window(tiny_model, tmp_path):
    model, tokenizer = tiny_model("mistral", sliding_window=8)
    session = chat(model, tokenizer)
    assert session.cache_length > 8
    export = load_cache(export_cache(session, tmp_path / "mistral.safetensors"))
    assert_matches_live(export, session)
    for layer in export.layers:
        assert layer["kind"] == "sliding" and layer["window"] == 8
        assert layer["filled"] == 7 and layer["seen"] == session.cache_length  # the last window-1 positions
        assert layer["held_from"] == session.cache_length - 7


def test_static_cache_export_slices_to_the_filled_slots(tiny_model, tmp_path):
    model, tokenizer = tiny_model("llama")
    session = chat(model, tokenizer, cache="static", max_cache_len=256)
    assert session.cache.layers[0].keys.shape[-2] == 256 > session.cache_length
    export = load_cache(export_cache(session, tmp_path / "static.safetensors"))
    assert_matches_live(export, session)
    for layer, keys in zip(export.layers, export.keys):
        assert layer["kind"] == "static" and layer["capacity"] == 256 and layer["slots"] == 256
        assert keys.shape[-2] == layer["filled"] == session.cache_length
    assert export.meta["cache"] == "static" and export.meta["capacity"] == 256


@pytest.mark.parametrize("arch,kwargs", [("llama", {}), ("mistral", {"sliding_window": 8})], ids=["llama", "mistral"])
def test_an_export_mid_turn_continues_like_the_session(tiny_model, tmp_path, arch, kwargs):
    """Rebuilt as a DynamicCache, the export gives the next step the same logits as the live cache."""
    model, tokenizer = tiny_model(arch, **kwargs)
    session = ChatSession(model, tokenizer, SessionConfig(max_new_tokens=50))
    session.send(TURNS[0])
    for _ in range(3):
        session.step()
    export = load_cache(export_cache(session, tmp_path / "mid.safetensors"))
    assert export.meta["step"] == session.steps == 4
    rebuilt = to_dynamic_cache(export, model.config)
    assert int(rebuilt.get_seq_length()) == session.cache_length
    token, position = session.pending.id, session.cursor
    with torch.inference_mode():
        logits = (
            model(
                input_ids=torch.tensor([[token]]),
                position_ids=torch.tensor([[position]]),
                past_key_values=rebuilt,
                use_cache=True,
            )
            .logits[0, -1]
            .float()
        )
    session.step()
    assert torch.allclose(logits, session.last_logits, atol=1e-5), (logits - session.last_logits).abs().max()


def test_export_does_not_change_the_session(tiny_model, tmp_path):
    model, tokenizer = tiny_model("llama")
    session = chat(model, tokenizer, turns=TURNS[:1])
    before = [(layer.keys.data_ptr(), layer.keys.clone()) for layer in session.cache.layers]
    steps, cursor, length = session.steps, session.cursor, session.cache_length
    export_cache(session, tmp_path / "x.safetensors")
    assert (session.steps, session.cursor, session.cache_length) == (steps, cursor, length)
    for (ptr, keys), layer in zip(before, session.cache.layers):
        assert layer.keys.data_ptr() == ptr and torch.equal(layer.keys, keys)


def test_an_unwritable_path_raises_and_leaves_nothing(tiny_model, tmp_path):
    model, tokenizer = tiny_model("llama")
    session = chat(model, tokenizer, turns=TURNS[:1])
    blocker = tmp_path / "file.txt"
    blocker.write_text("a regular file")
    target = blocker / "x.safetensors"  # fails for root too: a file is not a directory
    with pytest.raises(ExportError, match=str(target)):
        export_cache(session, target)
    assert blocker.read_text() == "a regular file" and sorted(os.listdir(tmp_path)) == ["file.txt"]
    with pytest.raises(ExportError, match="cannot write"):
        export_cache(session, tmp_path)  # a directory is not a file name


def test_a_failed_write_keeps_the_old_export_and_leaves_no_temporary(tiny_model, tmp_path, monkeypatch):
    model, tokenizer = tiny_model("llama")
    session = chat(model, tokenizer, turns=TURNS[:1])
    path = export_cache(session, tmp_path / "cache.safetensors")
    old = path.read_bytes()
    import safetensors.torch

    def half_written(tensors, filename, metadata=None):
        with open(filename, "wb") as handle:
            handle.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", half_written)
    with pytest.raises(ExportError, match="No space left"):
        export_cache(session, path)
    assert path.read_bytes() == old and sorted(os.listdir(tmp_path)) == ["cache.safetensors"]


def test_load_cache_names_the_path_of_what_it_cannot_read(tmp_path):
    with pytest.raises(ExportError, match="no such cache export"):
        load_cache(tmp_path / "missing.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not safetensors at all")
    with pytest.raises(ExportError, match=str(junk)):
        load_cache(junk)
    from safetensors.torch import save_file

    other = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2)}, str(other), metadata={"format": "pt"})
    with pytest.raises(ExportError, match="schema"):
        load_cache(other)


def test_export_from_the_snapshot_callback_at_a_chosen_step(tiny_model, tmp_path):
    """What the headless runner's --export-cache-at STEP does: export inside on_snapshot."""
    model, tokenizer = tiny_model("mistral", sliding_window=8)
    session = ChatSession(model, tokenizer, SessionConfig(max_new_tokens=6))
    target, seen = tmp_path / "step5.safetensors", {}

    def on_snapshot(snapshot):
        if snapshot.step == 5:
            export_cache(session, target)
            seen["keys"] = [layer.keys.clone() for layer in session.cache.layers]
            seen["ids"], seen["cursor"] = snapshot.buffer.ids(), snapshot.cursor

    session.on_snapshot.add(on_snapshot)
    for turn in TURNS:
        session.send(turn)
        session.generate()
    export = load_cache(target)
    assert export.meta["step"] == export.meta["last_snapshot_step"] == 5
    assert export.token_ids == seen["ids"] and export.meta["cursor"] == seen["cursor"]
    assert all(torch.equal(k, live) for k, live in zip(export.keys, seen["keys"]))

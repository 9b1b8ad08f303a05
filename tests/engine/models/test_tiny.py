"""kvtui.engine.models.tiny: offline tiny models must load through the Auto* classes like real checkpoints."""

from __future__ import annotations

import ast
import json
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import kvtui.engine.models.tiny as tiny
from kvtui.engine.models.tiny import ARCHES, build_tiny

# What each arch should look like by default, written out independently of tiny.SPECS.
EXPECTED = {
    "llama": dict(bos="<s>", eos="</s>", eot="<|end|>", adds_bos=True, template_bos=True, window=None, layers=2),
    "qwen2": dict(
        bos="<|endoftext|>",
        eos="<|im_end|>",
        eot="<|im_end|>",
        adds_bos=False,
        template_bos=False,
        window=None,
        layers=2,
    ),
    "qwen3": dict(
        bos="<|endoftext|>",
        eos="<|im_end|>",
        eot="<|im_end|>",
        adds_bos=False,
        template_bos=False,
        window=None,
        layers=2,
    ),
    "mistral": dict(bos="<s>", eos="</s>", eot="</s>", adds_bos=True, template_bos=True, window=8, layers=2),
    "gemma3": dict(
        bos="<bos>", eos="<eos>", eot="<end_of_turn>", adds_bos=False, template_bos=True, window=8, layers=4
    ),
    "gpt2": dict(
        bos="<|endoftext|>",
        eos="<|endoftext|>",
        eot="<|im_end|>",
        adds_bos=False,
        template_bos=False,
        window=None,
        layers=2,
    ),
}
USER = [{"role": "user", "content": "What is k?"}]
TEXT = "Let's start by defining a variable k equal to 5. What is k?"


@pytest.fixture(scope="session")
def build(tmp_path_factory):
    """Session-wide build cache: each (arch, options) is built once."""
    cache: dict[tuple, Path] = {}

    def _build(arch: str, **kwargs) -> Path:
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = build_tiny(arch, tmp_path_factory.mktemp(arch), **kwargs)
        return cache[key]

    return _build


@cache
def load(path: Path):
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)


def chat_ids(tok, messages=USER) -> list[int]:
    # transformers 5.x returns a BatchEncoding here, 4.x a plain list.
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out) if isinstance(out, list) else list(out["input_ids"])


def test_arches_match_expectations():
    assert set(ARCHES) == set(EXPECTED)


@pytest.mark.parametrize("arch", ARCHES)
def test_chat_template_and_forward(build, arch):
    tok, model = load(build(arch))
    ids = chat_ids(tok)
    exp = EXPECTED[arch]
    # The template writes BOS where the family's does, and apply_chat_template adds no second one.
    bos_id = tok.convert_tokens_to_ids(exp["bos"])
    assert (ids[0] == bos_id) == exp["template_bos"]
    assert ids.count(bos_id) == (1 if exp["template_bos"] else 0)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tok))
    assert model.config.vocab_size == len(tok)
    assert 400 <= len(tok) <= 600
    assert model.dtype == torch.float32
    assert model.config.num_hidden_layers == exp["layers"]


@pytest.mark.parametrize("arch", ARCHES)
def test_default_post_processor(build, arch):
    tok, _ = load(build(arch))
    plain = tok("hello", add_special_tokens=False)["input_ids"]
    bos = [tok.convert_tokens_to_ids(EXPECTED[arch]["bos"])]
    assert tok("hello")["input_ids"] == (bos + plain if EXPECTED[arch]["adds_bos"] else plain)


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("bos,eos", [(True, True), (False, False), (False, True)])
def test_post_processor_flags(build, arch, bos, eos):
    tok, _ = load(build(arch, bos=bos, eos=eos))
    b = [tok.convert_tokens_to_ids(EXPECTED[arch]["bos"])] if bos else []
    e = [tok.convert_tokens_to_ids(EXPECTED[arch]["eos"])] if eos else []
    a = tok("hello", add_special_tokens=False)["input_ids"]
    c = tok("world", add_special_tokens=False)["input_ids"]
    assert tok("hello")["input_ids"] == b + a + e
    assert tok("hello", "world")["input_ids"] == b + a + e + b + c + e


@pytest.mark.parametrize("arch", ARCHES)
def test_loaded_tokenizer_matches_tokenizer_json(build, arch):
    # transformers 5.x may swap in a model-specific class (qwen2 -> Qwen2Tokenizer) that
    # rebuilds the pipeline; it must still tokenize exactly as the saved tokenizer.json.
    path = build(arch)
    tok, _ = load(path)
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    text = TEXT + "  12345\n\nüñï 🙂 multiplied"
    assert tok(text, add_special_tokens=False)["input_ids"] == raw.encode(text, add_special_tokens=False).ids
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text


@pytest.mark.parametrize("arch", ARCHES)
def test_tokenizer_config_is_4x_readable(build, arch):
    cfg = json.loads((build(arch) / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"


@pytest.mark.parametrize("arch", ARCHES)
def test_generation_config_stops_on_end_of_turn(build, arch):
    tok, model = load(build(arch))
    exp = EXPECTED[arch]
    eos_ids = model.generation_config.eos_token_id
    assert isinstance(eos_ids, list)
    assert tok.convert_tokens_to_ids(exp["eot"]) in eos_ids
    assert tok.convert_tokens_to_ids(exp["eos"]) in eos_ids
    assert model.config.bos_token_id == tok.bos_token_id == model.generation_config.bos_token_id
    assert model.config.pad_token_id == tok.pad_token_id == model.generation_config.pad_token_id


def _cache_layers(model) -> list[tuple[str, int | None]]:
    cache = DynamicCache(config=model.config)
    return [(type(layer).__name__, getattr(layer, "sliding_window", None)) for layer in cache.layers]


@pytest.mark.parametrize("arch,window", [("mistral", None), ("mistral", 5), ("gemma3", None), ("gemma3", 6)])
def test_sliding_window_cache(build, arch, window):
    _, model = load(build(arch, sliding_window=window))
    expected_window = window or EXPECTED[arch]["window"]
    layers = _cache_layers(model)
    sliding = [w for name, w in layers if "Sliding" in name]
    assert sliding and all(w == expected_window for w in sliding)
    if arch == "gemma3":
        assert any("Sliding" not in name for name, _ in layers)  # hybrid: a full layer too


def test_gemma3_layer_override_keeps_a_full_layer(build):
    _, model = load(build("gemma3", layers=2))
    assert [("Sliding" in name) for name, _ in _cache_layers(model)] == [True, False]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gpt2"])
def test_full_attention_archs_have_no_sliding_layers(build, arch):
    _, model = load(build(arch))
    assert all("Sliding" not in name for name, _ in _cache_layers(model))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_double_bos_pitfall(build, arch):
    # Rendering to text, then tokenizing with special tokens, doubles BOS when both the
    # template and the tokenizer add one: the real Llama/Gemma pitfall.
    tok, _ = load(build(arch, bos=True))
    text = tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    ids = tok(text)["input_ids"]
    assert ids[:2] == [tok.bos_token_id] * 2
    assert ids[1:] == chat_ids(tok)


@pytest.mark.parametrize("arch", ARCHES)
def test_deterministic(build, tmp_path, arch):
    a = load_file(str(build(arch) / "model.safetensors"))
    b = load_file(str(build_tiny(arch, tmp_path / "again") / "model.safetensors"))
    c = load_file(str(build_tiny(arch, tmp_path / "seed1", seed=1) / "model.safetensors"))
    first = [k for k in a if ".0." in k]
    assert first and a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in first if a[k].std() > 0)
    same_tok = (build(arch) / "tokenizer.json").read_text() == (tmp_path / "again" / "tokenizer.json").read_text()
    assert same_tok


def test_custom_template(build):
    tok, _ = load(build("qwen3", template="{% for m in messages %}{{ m['content'] }}{% endfor %}"))
    assert tok.apply_chat_template(USER, tokenize=False) == "What is k?"


def test_chat_continues_past_the_window(build):
    # A short multi-turn chat is already longer than the default mistral window.
    tok, model = load(build("mistral"))
    messages = [
        {"role": "user", "content": "Let's start by defining a variable k equal to 5. What is k?"},
        {"role": "assistant", "content": "k is equal to 5."},
        {"role": "user", "content": "What is k multiplied by 3?"},
    ]
    ids = chat_ids(tok, messages)
    assert len(ids) > EXPECTED["mistral"]["window"]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == len(ids)
    # Only the window's tail is kept (5.23 keeps window - 1 tokens; don't pin the exact count).
    assert cache.layers[0].keys.shape[-2] <= EXPECTED["mistral"]["window"] < len(ids)


def test_unknown_arch(tmp_path):
    with pytest.raises(ValueError, match="gemma3"):
        build_tiny("no_such_arch", tmp_path)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gpt2"])
def test_sliding_window_rejected_without_support(tmp_path, arch):
    with pytest.raises(ValueError, match="sliding"):
        build_tiny(arch, tmp_path, sliding_window=4)


def test_no_ui_imports():
    tree = ast.parse(Path(tiny.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"textual", "rich"}

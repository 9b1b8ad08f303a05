"""Quantized, offloaded and compiled static caches: real storage in LayerInfo, verify's measured error,
greedy tokens of the compiled static run identical to the uncompiled one."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from quantized_truth import quantization_errors

from kvtui.engine import ChatSession, SessionConfig
from kvtui.engine.chat.session import SessionError
from kvtui.engine.records.codec import from_record, to_record
from kvtui.engine.records.snapshot import StepSnapshot, TokenBuffer, VerifyResult
from kvtui.fmt import quantization_text

TURNS = ["Let's start by defining a variable k equal to 5. What is k?", "Now multiply k by 3. What is k?"]


def _knows(backend: str) -> bool:
    """Feature test: does the installed QuantizedCache take this backend (4.57: no fp8)?"""
    from transformers import PretrainedConfig, QuantizedCache

    try:
        QuantizedCache(backend=backend, config=PretrainedConfig(num_hidden_layers=1))
    except ValueError as exc:
        return "Unknown quantization backend" not in str(exc)
    except Exception:  # noqa: BLE001 - past the backend's name
        return True
    return True


FP8 = _knows("fp8")
# Every backend the installed transformers offers is tested: quanto and hqq are installed by make test
# (hqq beside the environment, see tests/conftest.py); one that is missing fails its tests, it is not skipped.
BACKENDS = ([("fp8", 4)] if FP8 else []) + [(name, bits) for name in ("quanto", "hqq") for bits in (4, 2)]
PACKAGES = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq", "hqq")}  # module, pip name


def _chat(session, turns=TURNS):
    for turn in turns:
        session.send(turn)
        session.generate()
    return session.last


def _storage(obj, seen) -> int:
    """Independent byte count: every distinct storage under a quantized state."""
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            return sum(_storage(getattr(obj, n), seen) for n in obj.__tensor_flatten__()[0])
        ptr = obj.untyped_storage().data_ptr()
        if ptr in seen:
            return 0
        seen.add(ptr)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, (tuple, list)):
        return sum(_storage(o, seen) for o in obj)
    if isinstance(obj, dict):
        return sum(_storage(o, seen) for o in obj.values())
    return 0


@pytest.mark.parametrize("backend,bits", BACKENDS, ids=[f"{b}-{n}bit" for b, n in BACKENDS])
def test_quantized_cache_reports_storage_and_measured_error(tiny_model, backend, bits):
    module, pip_name = PACKAGES.get(backend, (None, None))
    if module and importlib.util.find_spec(module) is None:
        pytest.fail(f"{module} is not installed: make test installs it (see the Makefile); pip install {pip_name}")
    model, tokenizer = tiny_model("llama")
    session = ChatSession(
        model, tokenizer, SessionConfig(cache="quantized", cache_backend=backend, cache_bits=bits, max_new_tokens=8)
    )
    last = _chat(session)
    cache_len = session.cache_length
    assert cache_len > 32  # past the full-precision window: most tokens are quantized
    for info, layer in zip(last.layers, session.cache.layers, strict=True):
        assert info.kind == "quantized"
        assert info.quant_bits == (8 if backend == "fp8" else bits)
        assert info.seen == info.filled == cache_len and info.k_shape[2] == cache_len
        seen: set = set()
        quant = _storage(layer._quantized_keys, seen) + _storage(layer._quantized_values, seen)
        residual = layer.keys.shape[-2] if layer.keys.dim() == 4 else 0
        assert info.quant_bytes == quant > 0
        assert info.residual == residual
        full_precision = (
            (layer.keys.untyped_storage().nbytes() + layer.values.untyped_storage().nbytes()) if residual else 0
        )
        assert info.bytes == quant + full_precision
    # fp32 K/V of every token would take this much; the quantized layers must be smaller (fp8 keeps its window too)
    dense = sum(2 * i.k_shape[0] * i.k_shape[1] * i.k_shape[2] * i.k_shape[3] * 4 for i in last.layers)
    assert last.cache_bytes < dense
    result = session.verify()
    assert result.max_abs_diff > 1e-6  # lossy: it is really quantized (not silently full precision)
    assert result.max_abs_diff <= result.tolerance and result.ok, result
    # each layer's K/V error, against what attention really gets: a copy of the cache asked for its K/V by its own
    # update() (no new token: transformers dequantizes and joins the residual itself), and the recompute's K/V
    assert result.layer_errors is not None and len(result.layer_errors) == len(session.cache.layers)
    # (update() with no new token on the session's own cache: the test is done with the session)
    assert result.layer_errors == quantization_errors(model, session.cache, [t.id for t in session.buffer]), backend
    assert all(0 < max(pair) < 0.5 for pair in result.layer_errors), result.layer_errors
    # in the record (replay reads them back) and in words: the worst layer named
    assert from_record(VerifyResult, to_record(result)).layer_errors == result.layer_errors
    worst = max(range(len(result.layer_errors)), key=lambda i: max(result.layer_errors[i]))
    assert f"worst in layer {worst}: K {result.layer_errors[worst][0]:.2%}" in quantization_text(result.layer_errors)
    # the trace round-trips the new fields
    again = from_record(StepSnapshot, to_record(last), buffer=TokenBuffer(list(last.buffer)))
    assert again.layers == last.layers


def test_quantized_rewind_recomputes_and_stays_consistent(tiny_model):
    model, tokenizer = tiny_model("llama")
    backend = "fp8" if FP8 else "quanto"
    session = ChatSession(model, tokenizer, SessionConfig(cache="quantized", cache_backend=backend, max_new_tokens=6))
    _chat(session)
    n = session.cache_length
    session.rewind(4)
    assert session.cache_length == n - 4 == len(session.buffer)
    assert any(d.code == "state-rewind" and "quantized" in d.message for d in session.diagnostics)
    assert session.verify().ok


def test_fp8_works_or_is_refused_in_one_line(tiny_model):
    """fp8 where the installed QuantizedCache has it; else one line, before any cache is built."""
    model, tokenizer = tiny_model("llama")
    config = SessionConfig(cache="quantized", cache_backend="fp8", max_new_tokens=2)
    if FP8:
        session = ChatSession(model, tokenizer, config)
        session.send(TURNS[0])
        assert all(layer.kind == "quantized" for layer in session.last.layers)
    else:
        with pytest.raises(SessionError, match="has no fp8 quantized cache") as caught:
            ChatSession(model, tokenizer, config)
        assert "\n" not in str(caught.value)


def test_unknown_backend_and_missing_package_are_one_line_refusals(tiny_model):
    model, tokenizer = tiny_model("llama")
    with pytest.raises(SessionError, match="unknown quantization backend 'nope'"):
        ChatSession(model, tokenizer, SessionConfig(cache="quantized", cache_backend="nope"))


def test_offloaded_cache_on_cpu_is_a_one_line_refusal(tiny_model):
    """transformers' offloaded update waits on torch.cuda streams: on a CPU-only torch it would raise
    "Torch not compiled with CUDA enabled" mid-forward. kvtui refuses up front instead."""
    model, tokenizer = tiny_model("qwen3")
    with pytest.raises(SessionError, match="--cache offloaded needs the model on a CUDA device"):
        ChatSession(model, tokenizer, SessionConfig(cache="offloaded"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="transformers' offloaded cache needs CUDA")
def test_offloaded_cache_is_exact_and_shows_device(tiny_model):
    model, tokenizer = tiny_model("qwen3")
    model = model.to("cuda")
    try:
        _offloaded_run(model, tokenizer)
    finally:
        model.to("cpu")  # the fixture's model is shared


def _offloaded_run(model, tokenizer):
    session = ChatSession(model, tokenizer, SessionConfig(cache="offloaded", max_new_tokens=5))
    last = _chat(session)
    assert session.cache.offloading
    for info, layer in zip(last.layers, session.cache.layers, strict=True):
        assert info.offloaded and info.device == str(layer.keys.device)
    ids = torch.tensor([[t.id for t in last.buffer]], device="cuda")
    with torch.inference_mode():
        full = model(input_ids=ids, use_cache=False).logits[0, -1]
    assert torch.allclose(session.last_logits, full, atol=1e-5)
    session.rewind(2)
    assert session.verify().ok


def test_compile_needs_a_static_cache(tiny_model):
    model, tokenizer = tiny_model("llama")
    with pytest.raises(SessionError, match="--compile needs --cache static"):
        ChatSession(model, tokenizer, SessionConfig(compile=True))


def test_compiled_static_decode_gives_identical_greedy_tokens(tiny_model):
    torch._dynamo.reset()
    model, tokenizer = tiny_model("llama")
    runs = {}
    for compiled in (False, True):
        session = ChatSession(
            model, tokenizer, SessionConfig(cache="static", max_cache_len=160, compile=compiled, max_new_tokens=8)
        )
        snaps = []
        for turn in TURNS:
            session.send(turn)
            session.generate(on_step=snaps.append)
        runs[compiled] = (session.buffer.ids(), snaps, session)
    assert runs[True][0] == runs[False][0]  # greedy tokens identical
    snaps, session = runs[True][1], runs[True][2]
    assert all(s.compiled for s in snaps)
    assert snaps[0].compile_ms is not None and snaps[0].compile_ms > 0  # the first decode step compiled
    assert session.compiles >= 1 and snaps[-1].recompiles == session.recompiles
    assert all(s.compile_ms is None for s in snaps[1:]) or session.recompiles > 0
    assert session.verify().ok


def test_quanto_kernels_are_prepared_at_load_under_a_progress_line(monkeypatch):
    """optimum-quanto builds its kernels when a quantized value is first read back (mid-turn in a chat): kvtui
    makes that happen at load, saying so, and a build that fails is one line before any turn."""
    import optimum.quanto

    from kvtui.engine.chat.configure import prepare_cache_backend

    said: list[str] = []
    prepare_cache_backend(SessionConfig(cache="dynamic"), "cpu", said.append)
    prepare_cache_backend(SessionConfig(cache="quantized", cache_backend="fp8"), "cpu", said.append)
    assert said == []  # nothing to prepare
    read_back = []
    real = optimum.quanto.quantize_weight

    def quantize_weight(*args, **kwargs):
        quantized = real(*args, **kwargs)
        read_back.append(quantized.dequantize())  # what the round trip must reach: the kernels' first use
        return quantized

    monkeypatch.setattr(optimum.quanto, "quantize_weight", quantize_weight)
    prepare_cache_backend(SessionConfig(cache="quantized", cache_backend="quanto", cache_bits=2), "cpu", said.append)
    assert len(said) == 1 and said[0].startswith("optimum-quanto: preparing its kernels") and len(read_back) == 1

    def broken(*args, **kwargs):
        raise RuntimeError("Error building extension 'quanto_cpp'\nninja: build stopped: subcommand failed.")

    monkeypatch.setattr(optimum.quanto, "quantize_weight", broken)
    with pytest.raises(SessionError) as caught:
        prepare_cache_backend(SessionConfig(cache="quantized", cache_backend="quanto"), "cpu")
    assert (
        str(caught.value)
        == "optimum-quanto could not prepare its kernels for cpu: Error building extension 'quanto_cpp'"
    )

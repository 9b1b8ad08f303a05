"""Verify in a watched program whose cache is a `QuantizedCache`: besides the logits, each layer's K/V error
(dequantized, residual included) against the full-precision recompute, equal to what the cache's own update()
gives attention (tests/quantized_truth.py); the program's tokens are the same watched."""

from __future__ import annotations

import torch
from quantized_truth import quantization_errors

from kvtui.engine.reading.introspect import make_cache
from kvtui.engine.watch.probe import watch
from kvtui.fmt import quantization_text


def _loop(model, ids, watcher=None, steps: int = 12):
    cache = make_cache("quantized", model.config, bits=4, backend="quanto")
    fed = list(ids[0].tolist())
    result = None
    with torch.inference_mode():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        for _ in range(steps):
            token = out.logits[:, -1:].argmax(-1)  # [1, 1]
            fed.append(int(token))
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
    if watcher is not None:
        result = watcher.verify()
    return cache, fed, result


def test_verify_of_a_watched_quantized_cache_says_each_layers_error(tiny_model):
    model, tokenizer = tiny_model("llama")
    ids = tokenizer("the cat sat on the mat and then it went to sleep on the warm floor", return_tensors="pt")
    ids = ids["input_ids"]  # [1, n]
    _, plain, _ = _loop(model, ids)
    with watch(model, tokenizer) as watcher:
        cache, fed, result = _loop(model, ids, watcher)
    assert fed == plain  # the program computes the same watched
    errors = tuple(map(tuple, result["layer_errors"]))
    assert len(errors) == model.config.num_hidden_layers and all(0 < max(pair) < 0.5 for pair in errors), errors
    assert errors == quantization_errors(model, cache, fed)
    assert "quantization error" in quantization_text(errors)

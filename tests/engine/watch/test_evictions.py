"""Compressed caches a program makes itself, watched in-process on a tiny Llama (issue 54): which positions each
layer holds is read from the cache's tensors and equals what the program kept (the truth here is the program's
own slicing), an eviction is said as one, the position rule follows what the kept keys encode (the physical-length
bug is found, the logical positions raise nothing), verify reports what the compression cost, and the trace
carries the held runs. Real presses (kvpress) are in tests/kvpress."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from kvtui.engine.reading.verify import compression_cost
from kvtui.engine.records.replay import Replay
from kvtui.engine.records.trace import read_trace
from kvtui.engine.watch.probe import watch

SINKS, WINDOW = 4, 12


def _prompt(model, length: int = 48) -> torch.Tensor:
    generator = torch.Generator().manual_seed(2)
    return (torch.randperm(model.config.vocab_size - 8, generator=generator)[:length] + 4).unsqueeze(0)


def _keep(cache, keep: list[int], layers=None) -> None:
    """The program's own eviction: every (or the given) layer keeps the slots `keep`, in order."""
    index = torch.tensor(keep)
    for i, layer in enumerate(cache.layers):
        if layers is None or i in layers:
            layer.keys, layer.values = layer.keys[:, :, index], layer.values[:, :, index]


def _runs(positions) -> tuple:
    out: list[list[int]] = []
    for p in sorted(positions):
        if out and out[-1][1] == p:
            out[-1][1] = p + 1
        else:
            out.append([p, p + 1])
    return tuple(tuple(r) for r in out)


def _decode(model, cache, out, steps: int, position) -> list:
    """Greedy steps at `position(step)`; returns the logits of each."""
    logits = []
    for step in range(steps):
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        out = model(input_ids=token, position_ids=torch.tensor([[position(step)]]), past_key_values=cache)
        logits.append(out.logits[0, -1])
    return logits


@pytest.mark.parametrize("physical", [False, True], ids=["logical-positions", "physical-length-bug"])
def test_sinks_and_window_held_positions_and_the_position_rule(tiny_model, physical, tmp_path):
    model, _ = tiny_model("llama")
    ids = _prompt(model)
    length = ids.shape[-1]
    kept = list(range(SINKS)) + list(range(length - WINDOW, length))
    snapshots = []
    trace = tmp_path / "run.jsonl"
    cache = DynamicCache()
    with watch(model, trace=str(trace), on_snapshot=snapshots.append) as watcher, torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache)
        _keep(cache, kept)
        if physical:  # the bug: decode at the cache's slot count, 16, 17, ...
            _decode(model, cache, out, 3, lambda step: SINKS + WINDOW + step)
        else:
            _decode(model, cache, out, 3, lambda step: length + step)
    codes = [d.code for d in watcher.diagnostics]
    evicted = [d for d in watcher.diagnostics if d.code == "cache-evicted"]
    assert len(evicted) == 1 and evicted[0].severity == "info"
    assert f"evicted {length - len(kept)} tokens from every layer" in evicted[0].message
    assert f"0–{SINKS - 1} and {length - WINDOW}–{length - 1}" in evicted[0].message
    if physical:
        gaps = [d for d in watcher.diagnostics if d.code == "position-gap"]
        assert codes.count("position-gap") == 1 and gaps[0].severity == "error"  # said once, not every step
        assert f"continue at position {length}" in gaps[0].message and "eviction noticed at step 2" in gaps[0].message
    else:
        assert set(codes) == {"cache-evicted"}
    for step, snapshot in enumerate(snapshots[1:], 1):  # every decode step: the kept ones and what was fed since
        expected = _runs(kept + list(range(length, length + step)))
        assert all(layer.held == expected and layer.held_heads is None for layer in snapshot.layers)
        assert all(layer.seen == length + step and layer.filled == len(kept) + step for layer in snapshot.layers)
        assert snapshot.buffer.ids()[:length] == ids[0].tolist()  # the buffer keeps what was fed, evicted or not
    replayed = Replay(read_trace(trace))
    assert [replayed.snapshot_at(s.step).layers for s in snapshots] == [s.layers for s in snapshots]  # via the trace
    last = [r for r in map(json.loads, trace.read_text().splitlines()) if r["type"] == "step"][-1]
    assert last["layers"][0]["held"] == [list(run) for run in snapshots[-1].layers[0].held]  # on disk


def test_one_layer_evicting_its_middle(tiny_model):
    model, _ = tiny_model("llama")
    ids = _prompt(model, 40)
    kept = list(range(10)) + list(range(30, 40))
    snapshots = []
    cache = DynamicCache()
    with watch(model, on_snapshot=snapshots.append) as watcher, torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache)
        _keep(cache, kept, layers={0})
        _decode(model, cache, out, 1, lambda step: 40 + step)
    assert {d.code for d in watcher.diagnostics} == {"cache-evicted"}
    assert "evicted per layer" in watcher.diagnostics[0].message
    layers = snapshots[-1].layers
    assert layers[0].held == ((0, 10), (30, 41)) and layers[0].filled == 21
    assert all(layer.held == ((0, 41),) and layer.filled == 41 for layer in layers[1:])


def test_a_press_that_keeps_k_and_v_of_different_tokens_is_an_error(tiny_model):
    model, _ = tiny_model("llama")
    ids = _prompt(model, 32)
    cache = DynamicCache()
    with watch(model) as watcher, torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache)
        for layer in cache.layers:  # K from the first 16, V from the last 16: a broken press
            layer.keys, layer.values = layer.keys[:, :, :16], layer.values[:, :, 16:]
        _decode(model, cache, out, 1, lambda step: 32 + step)
    errors = [d for d in watcher.diagnostics if d.code == "cache-evicted" and d.severity == "error"]
    assert errors and "different tokens for K and V" in errors[0].message


def test_merged_values_are_said(tiny_model):
    model, _ = tiny_model("llama")
    ids = _prompt(model, 32)
    cache = DynamicCache()
    with watch(model) as watcher, torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache)
        for layer in cache.layers:  # keep 0-7 and 24-31; the evicted middle's mean merged into slot 7's value
            merged = layer.values[:, :, 7:8] + layer.values[:, :, 8:24].mean(-2, keepdim=True)
            keep = torch.tensor(list(range(8)) + list(range(24, 32)))
            layer.keys = layer.keys[:, :, keep]
            layer.values = torch.cat([layer.values[:, :, :7], merged, layer.values[:, :, 24:]], -2)
        _decode(model, cache, out, 1, lambda step: 32 + step)
    note = next(d for d in watcher.diagnostics if d.code == "cache-evicted")
    n_layers = model.config.num_hidden_layers
    heads = model.config.num_key_value_heads
    assert note.severity == "info" and f"{n_layers * heads} kept values changed (merged)" in note.message


def test_a_crop_of_the_tail_is_still_a_crop(tiny_model):
    model, _ = tiny_model("llama")
    ids = _prompt(model, 24)
    cache = DynamicCache()
    with watch(model) as watcher, torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache)
        _keep(cache, list(range(20)))
        _decode(model, cache, out, 1, lambda step: 20 + step)
    assert [d.code for d in watcher.diagnostics] == ["cache-edited"]
    assert "cropped" in watcher.diagnostics[0].message


def test_verify_of_a_compressed_cache_reports_its_cost(tiny_model):
    model, _ = tiny_model("llama")
    ids = _prompt(model)
    length = ids.shape[-1]
    cache = DynamicCache()
    with watch(model) as watcher, torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache)
        _keep(cache, list(range(SINKS)) + list(range(length - WINDOW, length)))
        logits = _decode(model, cache, out, 2, lambda step: length + step)
        result = watcher.verify()
        fed = watcher.last.buffer.ids()
    full = model(input_ids=torch.tensor([fed])).logits[0, -1]  # the uncompressed run, computed here
    kl, top1 = compression_cost(logits[-1], full)
    assert result["ok"] and result["compressed_kl"] == pytest.approx(kl, abs=1e-5)
    assert result["compressed_top1"] == top1 == (int(full.argmax()) == int(logits[-1].argmax()))
    assert kl > 0  # the press dropped what the full run attends to
    assert "cache-mismatch" not in {d.code for d in watcher.diagnostics}
    note = next(d for d in watcher.diagnostics if d.code == "compression-cost")
    assert (
        note.severity == "info" and "over the run 1/1 verifies agree" in note.message if top1 else "0/1" in note.message
    )


def test_attention_is_not_mapped_onto_a_compressed_cache(tiny_model):
    """Key slots of a compressed cache are not buffer positions: its decode steps carry no attention (rather than
    attention drawn on the wrong tokens); the prefill before the eviction carries it."""
    model, _ = tiny_model("llama")
    ids = _prompt(model, 32)
    snapshots = []
    cache = DynamicCache()
    with watch(model, on_snapshot=snapshots.append, attention=True), torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache)
        _keep(cache, list(range(4)) + list(range(20, 32)))
        _decode(model, cache, out, 2, lambda step: 32 + step)
    assert snapshots[0].attention is not None
    assert [s.attention for s in snapshots[1:]] == [None, None]


def test_emptying_a_compressed_cache_is_a_reset_not_a_broken_press(tiny_model):
    model, _ = tiny_model("llama")
    ids = _prompt(model, 32)
    cache = DynamicCache()
    with watch(model) as watcher, torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache)
        _keep(cache, list(range(4)) + list(range(20, 32)))
        _decode(model, cache, out, 1, lambda step: 32 + step)
        for layer in cache.layers:  # the program starts over on the same cache
            layer.keys, layer.values = layer.keys[:, :, :0], layer.values[:, :, :0]
        model(input_ids=ids[:, :8], past_key_values=cache)
    assert [(d.code, d.severity) for d in watcher.diagnostics] == [
        ("cache-evicted", "info"),
        ("cache-edited", "warning"),
    ]
    assert "emptied" in watcher.diagnostics[1].message

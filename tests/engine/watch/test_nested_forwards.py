"""A forward inside a forward: a model's own decoder, called by its forward, is part of that step (its rotary's
positions are the step's); the same decoder called by the program is a step of its own (no logits: no top-k); a
second watched model run inside the first one's forward (a hook) is not a step, and its positions are not taken
for the outer step's."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from kvtui.engine.watch.probe import watch


def test_a_models_own_decoder_is_a_step_only_when_the_program_calls_it(tiny_model):
    model, tok = tiny_model("llama")
    ids = tok("the cache remembers what was fed", return_tensors="pt").input_ids  # [1, n]
    n = ids.shape[1]
    cache = DynamicCache(config=model.config)
    steps = []
    with watch(model, tok, on_snapshot=steps.append) as watcher, torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, use_cache=True)  # its decoder runs inside: one step
        model.model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)  # the decoder, called directly
        model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
    assert watcher.steps == 3 and len(steps) == 3
    assert [s.cache_length_before for s in steps] == [0, n, n + 1]
    assert [s.cache_seq_length for s in steps] == [n, n + 1, n + 2] and cache.get_seq_length() == n + 2
    assert [s.positions for s in steps] == [tuple(range(n)), (n,), (n + 1,)]
    assert {s.positions_source for s in steps} == {"rotary"}  # read inside the decoder, for the step that ran it
    assert steps[0].topk and steps[2].topk and steps[1].topk == ()  # the decoder alone returns no logits
    assert [s.phase for s in steps] == ["prefill", "decode", "decode"]
    assert not watcher.diagnostics, watcher.diagnostics


def test_another_watched_model_inside_a_forward_is_not_a_step(tiny_model, tiny_dir):
    model, tok = tiny_model("llama")
    other = AutoModelForCausalLM.from_pretrained(str(tiny_dir("llama")), dtype=torch.float32, num_hidden_layers=1)
    ids = tok("a model inside a model", return_tensors="pt").input_ids
    n = ids.shape[1]
    far = torch.arange(100, 100 + n).unsqueeze(0)  # positions no step of `model` uses

    def run_other(module, args, kwargs):  # a forward pre-hook of the program's: runs `other` inside the forward
        other(input_ids=ids, position_ids=far, use_cache=False)

    steps = []
    with watch(model, tok, on_snapshot=steps.append) as watcher, torch.inference_mode():
        watcher.attach(other)
        other(input_ids=ids, position_ids=far, use_cache=False)  # on its own: a step
        handle = model.register_forward_pre_hook(run_other, with_kwargs=True)
        try:
            model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True)
        finally:
            handle.remove()
    assert watcher.steps == 2 and len(steps) == 2
    assert steps[0].positions == tuple(range(100, 100 + n))
    assert steps[1].positions == tuple(range(n))  # the outer step's own, not the inner model's 100...
    assert steps[1].cache_seq_length == n

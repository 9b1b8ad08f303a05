"""4-D attention masks: generate() with a static cache passes the model a 4-D mask [batch, 1, n, slots] (a dict of
them per layer type on a model with sliding and full layers), not the 2-D mask it was given. A left-padded batch
generated that way is correct, so kvtui raises nothing on it and marks each row's pads as the tokenizer's mask
has them; a program's own 4-D mask is read the same way, so positions that count its pads are still named."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvtui

PROMPTS = ["Hello there, a longer prompt here that the window cannot hold", "Hi"]


def load(tiny_dir, arch: str):
    directory = tiny_dir(arch)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32), tokenizer


def loud(watcher) -> list[str]:
    return [f"{d.code}: {d.message}" for d in watcher.diagnostics if d.severity in ("warning", "error")]


# llama: one 4-D mask over the static cache's slots; gemma2: a dict, the full layers' mask read; mistral: every
# layer sliding, its decode masks over the window's slots (fewer than the tokens seen): the running count goes on
@pytest.mark.parametrize("arch", ["llama", "gemma2", "mistral"])
def test_a_left_padded_batch_generated_with_a_static_cache_raises_nothing(tiny_dir, arch):
    model, tokenizer = load(tiny_dir, arch)
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    pads = [int((row == 0).sum()) for row in batch["attention_mask"]]  # [batch]
    assert pads[0] == 0 and pads[1] > 8  # the short row is mostly pads, the long one longer than mistral's window
    with kvtui.watch(model, tokenizer) as watcher, torch.no_grad():
        model.generate(**batch, max_new_tokens=5, do_sample=False, cache_implementation="static")
    assert watcher.steps == 5 and not watcher.errors
    assert loud(watcher) == []
    for row, view in enumerate(watcher.last.rows):
        origins = [token.origin for token in view.buffer]
        assert origins.count("pad") == pads[row]
        real = [token.position for token in view.buffer if token.origin != "pad"]
        assert real == list(range(len(real)))  # each row's tokens from 0, its pads not counted


def test_positions_that_count_a_4d_masks_pads_are_named(tiny_dir):
    """The program's own 4-D bool mask (causal, pads masked) with the right positions raises nothing; with
    positions that count the pads, the padded row's first real token is named at the position it was given."""
    model, tokenizer = load(tiny_dir, "llama")
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    keep = batch["attention_mask"].bool()  # [batch, n]
    n = keep.shape[1]
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool))[None, None] & keep[:, None, None, :]  # [batch, 1, n, n]
    right = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)  # [batch, n]
    counted = torch.arange(n).expand(2, n)  # the bug: the pads counted
    pads = int((~keep[1]).sum())
    for positions, expected in ((right, []), (counted, ["position-gap"])):
        with kvtui.watch(model, tokenizer) as watcher, torch.no_grad():
            model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions)
        assert [message.split(":")[0] for message in loud(watcher)] == expected
        if expected:
            message = loud(watcher)[0]
            assert f"row 1 token {pads} was applied at position {pads} but 0 attended tokens precede it" in message


def test_one_4d_mask_for_every_row_is_read_for_each_row(tiny_dir):
    """A mask of batch 1 broadcast over the batch (a causal 4-D mask shared by unpadded rows, or a [1, n] 2-D one):
    each row reads it, nothing is padded, no alarm and no internal error."""
    model, tokenizer = load(tiny_dir, "llama")
    ids = tokenizer(["the same prompt", "the other one"], return_tensors="pt", padding=True)["input_ids"]
    n = ids.shape[1]
    for mask in (torch.tril(torch.ones(n, n, dtype=torch.bool))[None, None], torch.ones(1, n, dtype=torch.long)):
        with kvtui.watch(model, tokenizer) as watcher, torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
        assert watcher.steps == 1 and not watcher.errors and loud(watcher) == []
        assert [[t.origin for t in view.buffer] for view in watcher.last.rows] == [["fed"] * n] * 2

"""A watched step reads the device once, whatever the layer count: every tensor kvtui reads in a step (fed ids,
applied positions, top-k, the edit check of the cache's values) comes back in one transfer. Counted by patching
the tensor methods that copy data to the host (and so wait for a GPU), called from kvtui's frames."""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch
from transformers import DynamicCache

import kvtui
from kvtui.engine.watch import probe

KVTUI_DIR = os.path.dirname(os.path.abspath(kvtui.__file__)) + os.sep
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
HERE = os.path.abspath(__file__)
READS = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


def _from_kvtui() -> bool:
    """Whether the innermost frame outside torch and this file is kvtui's (the program's own reads are not)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(TORCH_DIR) and name != HERE:
            return name.startswith(KVTUI_DIR)
        frame = frame.f_back
    return False


@contextlib.contextmanager
def counting_reads(names=READS):
    """Yields a list: one entry per read kvtui made while the block ran (the method's name); `names`: other tensor
    methods to count instead (then each entry is the name and the shape of the tensor it was called on)."""
    seen: list[str] = []
    undo = []

    def wrap(owner, name):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            if _from_kvtui():
                seen.append(name if names is READS else (name, tuple(args[0].shape)))
            return original(*args, **kwargs)

        undo.append((owner, name, original))
        setattr(owner, name, counted)

    for name in names:
        wrap(torch.Tensor, name)
    if names is READS:
        wrap(torch, "equal")
    try:
        yield seen
    finally:
        for owner, name, original in reversed(undo):
            setattr(owner, name, original)


def _greedy(model, tokenizer, cache, token=None):
    """One forward of a user's greedy loop: the prompt first, then the last token; returns the next token."""
    ids = tokenizer("the cache holds every token", return_tensors="pt")["input_ids"] if token is None else token
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    return out.logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]


@pytest.mark.parametrize("layers", [2, 12])
@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])  # end-slot views vs autograd's write counters
def test_a_watched_decode_step_reads_the_device_once(tiny_model, tmp_path, layers, mode):
    model, tokenizer = tiny_model("llama", layers=layers)
    context = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    with context(), probe.watch(model, tokenizer, trace=tmp_path / "run.jsonl") as watcher:
        cache = DynamicCache(config=model.config)
        token = _greedy(model, tokenizer, cache)
        for _ in range(2):  # the first decode steps fill what is kept per cache and per call site
            token = _greedy(model, tokenizer, cache, token)
        per_step = []
        for _ in range(6):
            length = cache.get_seq_length()
            fed = int(token)
            with counting_reads() as reads:
                token = _greedy(model, tokenizer, cache, token)
            per_step.append(list(reads))
            snapshot = watcher.last
            # what the one transfer read is right: the fed id, the position, the top token (the program's argmax)
            assert snapshot.input_ids == (fed,)
            assert snapshot.positions == (length,)
            assert snapshot.cache_length_before == length and snapshot.cache_seq_length == length + 1
            assert snapshot.topk[0].id == int(token)
            assert len(snapshot.layers) == layers
            assert [layer.k_shape[2] for layer in snapshot.layers] == [length + 1] * layers
        assert watcher.errors == []
    assert per_step == [["tolist"]] * 6


def test_an_in_place_edit_is_still_caught_with_one_read(tiny_model, tmp_path):
    model, tokenizer = tiny_model("llama", layers=12)
    with torch.inference_mode(), probe.watch(model, tokenizer, trace=tmp_path / "run.jsonl") as watcher:
        cache = DynamicCache(config=model.config)
        token = _greedy(model, tokenizer, cache)
        token = _greedy(model, tokenizer, cache, token)
        cache.layers[5].values[:, :, 0] += 1.0  # slot 0 of layer 5, between two forwards
        with counting_reads() as reads:
            token = _greedy(model, tokenizer, cache, token)
        edited = [d for d in watcher.last.diagnostics if d.code == "cache-edited"]
        assert [d.message.split(": ", 1)[1].split(" (noticed")[0] for d in edited] == [
            "K/V values edited in place in 1 of 12 layers (5)"
        ]
        with counting_reads() as quiet:  # the next step: nothing changed, nothing said
            _greedy(model, tokenizer, cache, token)
        assert not [d for d in watcher.last.diagnostics if d.code == "cache-edited"]
    assert reads == ["tolist"] and quiet == ["tolist"]


def test_one_transfer_gives_back_what_each_tensor_holds():
    """Every dtype a step reads (ids, bool/int/float masks at any offset, float32 top-k pairs, half floats, empty
    rows) comes back from the one transfer as its own tolist() gives it."""
    from kvtui.engine.reading.introspect import HostReads

    mask = torch.ones(2, 7)
    mask[1, :2] = 0
    tensors = [
        torch.tensor([[5, 6, 7]]),  # ids [1, n]
        mask[:, 3:],  # float columns at an odd offset: converted, not viewed
        mask[:, 2:].sum(-1),  # [batch]
        mask.bool()[:, 1:],
        torch.tensor([1.5, -2.25, float("-inf"), 3.0e-8], dtype=torch.float32),  # viewed as int64 pairs
        torch.tensor([0.1, 0.2], dtype=torch.float16),
        torch.tensor([[1, 2]], dtype=torch.int32),
        torch.zeros(2, 0, dtype=torch.long),
    ]
    reads = HostReads()
    handles = [reads.add(t) for t in tensors]
    with counting_reads() as seen:
        values = [reads.rows(h) if t.dim() == 2 else reads.flat(h) for h, t in zip(handles, tensors)]
    assert seen == ["tolist"]
    for value, tensor in zip(values, tensors):
        expected = tensor.tolist()
        if tensor.dtype == torch.bool:
            expected = [[int(x) for x in row] for row in expected]
        assert value == expected
    with pytest.raises(RuntimeError, match="resolved already"):
        reads.add(torch.tensor([1]))


@pytest.mark.parametrize("layers", [2, 12])
def test_attention_joins_the_one_read(tiny_dir, tiny_model, tmp_path, layers):
    """watch(attention=True): every layer's newest-query attention and its region shares come back in the step's
    one transfer, with the values eager attention gives (an independent full forward, no cache), a left-padded
    2-D mask included (the pad region, the attended count the position checks use)."""
    from transformers import AutoModelForCausalLM

    model, tokenizer = tiny_model("llama", layers=layers)
    special = set(tokenizer.all_special_ids) | {i for i, a in tokenizer.added_tokens_decoder.items() if a.special}

    def partition(ids: list[int], special: set[int]) -> dict[str, list[int]]:
        """The regions, written from the token ids: the masked pad at 0 (it takes the sink's place), the special
        tokens, the last 16 positions, the rest (one turn)."""
        total, regions = len(ids), {"pad": [0]}
        for position in range(1, total):
            name = (
                "special"
                if ids[position] in special
                else f"last {min(16, total)}"
                if position >= total - 16
                else ("this turn")
            )
            regions.setdefault(name, []).append(position)
        return regions

    ids = tokenizer("the cache holds every token", return_tensors="pt")["input_ids"]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.cat([torch.tensor([[pad]]), ids], dim=1)  # [1, 1 + n]: one left pad
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # what generate() derives from a left-padded mask
    with torch.inference_mode(), probe.watch(model, tokenizer, trace=tmp_path / "run.jsonl", attention=True) as w:
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
        tokens, per_step, steps = ids, [], []
        for step in range(5):
            token = out.logits[:, -1:].argmax(-1)  # [1, 1]
            tokens, mask = torch.cat([tokens, token], dim=1), torch.cat([mask, torch.ones_like(token)], dim=1)
            position = positions[:, -1:] + 1
            positions = torch.cat([positions, position], dim=1)
            with counting_reads() as reads:
                out = model(
                    input_ids=token, attention_mask=mask, position_ids=position, past_key_values=cache, use_cache=True
                )
            if step >= 2:  # the first decode steps fill what is kept per cache and per call site
                per_step.append(list(reads))
            steps.append(w.last)
        assert w.errors == []
    assert per_step == [["tolist"]] * 3
    eager = AutoModelForCausalLM.from_pretrained(
        tiny_dir("llama", layers=layers), dtype=torch.float32, attn_implementation="eager"
    )
    for snapshot in steps:
        total = snapshot.cache_seq_length
        assert not [d for d in snapshot.diagnostics if d.severity != "info"], snapshot.diagnostics
        with torch.no_grad():
            full = eager(
                input_ids=tokens[:, :total],
                attention_mask=mask[:, :total],
                position_ids=positions[:, :total],
                output_attentions=True,
            )
        detail = snapshot.attention_detail
        assert len(snapshot.attention) == layers and "pad" in detail.regions
        for layer in range(layers):
            reference = full.attentions[layer][0, :, -1, :].mean(dim=0)  # [total]
            for position, weight in snapshot.attention[layer]:
                assert abs(reference[position].item() - weight) < 1e-5
            shares = dict(zip(detail.regions, detail.shares[layer]))
            assert sum(shares.values()) == pytest.approx(1, abs=1e-5)  # a partition: every position once
            for name, where in partition(tokens[0, :total].tolist(), special).items():
                assert shares[name] == pytest.approx(reference[where].sum().item(), abs=1e-5), name
            assert set(shares) == set(partition(tokens[0, :total].tolist(), special))


def test_a_continuing_mask_is_counted_not_summed(tiny_model, tmp_path):
    """A loop that extends its left-padded 2-D mask by the fed token: a decode step reads only the new column (the
    attended count goes on from the last forward's), the positions check still holds against it (no alarm for
    the right positions, position-gap for a wrong one), and a mask that does not continue is summed again."""
    model, tokenizer = tiny_model("llama", layers=2)
    ids = tokenizer("the cache holds every token", return_tensors="pt")["input_ids"]
    ids = torch.cat([torch.zeros(1, 3, dtype=ids.dtype), ids], dim=1)  # three left pads
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode(), probe.watch(model, tokenizer, trace=tmp_path / "run.jsonl") as watcher:
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
        position = positions[:, -1:]
        sums = []
        for step in range(4):
            token = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            position = position + 1 if step != 2 else position + 2  # step 2: a position off by one
            with counting_reads(("sum",)) as summed:
                out = model(
                    input_ids=token, attention_mask=mask, position_ids=position, past_key_values=cache, use_cache=True
                )
            sums.append([shape for _, shape in summed if shape == (1, mask.shape[1] - 1)])  # over the cached columns
            codes = [d.code for d in watcher.last.diagnostics]
            assert codes == (["position-gap"] if step == 2 else []), (step, watcher.last.diagnostics)
        assert watcher.last.positions == (int(position),)
        # a mask rebuilt with one column more than the cache holds: not the same mask, summed again
        token = out.logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones(1, 2, dtype=mask.dtype)], dim=1)
        with counting_reads(("sum",)) as summed:
            model(
                input_ids=token, attention_mask=mask, position_ids=position + 1, past_key_values=cache, use_cache=True
            )
        assert [shape for _, shape in summed].count((1, mask.shape[1] - 1)) == 1 and "mask-length" in [
            d.code for d in watcher.last.diagnostics
        ]
        assert watcher.errors == []
    assert sums == [[]] * 4

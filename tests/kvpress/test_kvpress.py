"""Real kvpress presses under kvtui's watch (transformers 4.57: kvpress pins <5.3, so `make test` runs this folder
in .venv-compat only). For every press family, the positions kvtui reads as held in each layer and KV head equal
what the press kept, worked out here independently: the press's own `compress` is wrapped to keep its input and
output K/V, and each kept row is found in the input by dense equality. No alarm but the eviction's own note, and
the tokens are those of the same run unwatched. The corpus programs (tests/kvpress_corpus) run through the CLI."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvtui.engine.chat.loader import tiny_model_dir
from kvtui.engine.watch.probe import Gate, watch

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "kvpress_corpus"

# kvpress is imported by the tests, not at collection: its import wraps every attention function of transformers
# for the whole process (kvpress.attention_patch), which the engine tests collected beside it must not see
PRESSES = {
    "knorm": lambda kp: kp.KnormPress(compression_ratio=0.5),
    "snapkv": lambda kp: kp.SnapKVPress(compression_ratio=0.5, window_size=8),
    "streaming": lambda kp: kp.StreamingLLMPress(compression_ratio=0.5, n_sink=4),
    "expected-attention": lambda kp: kp.ExpectedAttentionPress(compression_ratio=0.5, n_future_positions=4),
    "pyramidkv": lambda kp: kp.PyramidKVPress(compression_ratio=0.5, window_size=4),
    "rerotation": lambda kp: kp.KeyRerotationPress(press=kp.KnormPress(compression_ratio=0.5)),
}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir("tiny:llama"), dtype=torch.float32).eval()


def _prompt(model, length: int = 64) -> torch.Tensor:
    """Distinct token ids (no id twice: layer 0's values are then distinct too, so rows identify tokens)."""
    generator = torch.Generator().manual_seed(1)
    return (torch.randperm(model.config.vocab_size - 8, generator=generator)[:length] + 4).unsqueeze(0)


def _kept_by_press(press) -> dict[int, list[set[int]]]:
    """Wrap the press's compress (on this test's own press object): per layer, per KV head, the input positions
    whose value rows the output holds (a prefill's input slot is its position)."""
    kept: dict[int, list[set[int]]] = {}
    original = press.compress

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        new_keys, new_values = original(module, hidden_states, keys, values, attentions, kwargs)
        # [heads, m, n]: which input row each output row equals (values: a re-rotated key changes, its value not)
        same = (new_values[0][:, :, None, :] == values[0][:, None, :, :]).all(-1)
        kept[module.layer_idx] = [set(torch.nonzero(head)[:, 1].tolist()) for head in same]
        return new_keys, new_values

    press.compress = compress
    return kept


@pytest.mark.parametrize("name", list(PRESSES))
def test_held_positions_equal_what_the_press_kept(model, name):
    import kvpress

    ids = _prompt(model)
    with torch.no_grad(), PRESSES[name](kvpress)(model):
        plain = model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    press = PRESSES[name](kvpress)
    kept = _kept_by_press(press)
    snapshots = []
    with watch(model, on_snapshot=snapshots.append) as watcher, torch.no_grad(), press(model):
        watched = model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert torch.equal(plain, watched)  # the same tokens watched
    assert kept and len(kept) == model.config.num_hidden_layers
    if name == "rerotation":
        # generate() decodes at the uncompressed length (64) while the re-rotated keys encode 0..31: the query
        # stands 32 positions past them, the real bug of re-rotation without moving the cursor (kvpress's own
        # pipeline moves it: tests/kvpress_corpus/pipeline_rerotation.py raises nothing)
        assert {d.code for d in watcher.diagnostics} == {"cache-evicted", "cursor-mismatch", "position-gap"}
        assert "continue at position 32" in next(d for d in watcher.diagnostics if d.code == "position-gap").message
    else:
        assert {d.code for d in watcher.diagnostics} == {"cache-evicted"}, watcher.diagnostics
        assert all(d.severity == "info" for d in watcher.diagnostics)
    prefill = snapshots[0]
    for layer in prefill.layers:
        heads = kept[layer.index]
        runs = layer.held_heads or (layer.held,) * len(heads)
        held = [{p for start, stop in head for p in range(start, stop)} for head in runs]
        assert held == heads, (name, layer.index)
        assert layer.seen == ids.shape[-1] and layer.filled == max(len(h) for h in heads)
    if name == "rerotation":
        assert "re-rotated to their slots' positions" in watcher.diagnostics[0].message
    # every decode step: each layer holds one more
    assert [s.layers[0].seen for s in snapshots[1:]] == list(range(ids.shape[-1] + 1, ids.shape[-1] + 4))


def _model_of(program: Path) -> str:
    return re.search(r"^kvtui-model: (.+)$", program.read_text(), re.M).group(1).strip()


@pytest.mark.parametrize("program", sorted(CORPUS.glob("*.py")), ids=lambda p: p.stem)
def test_kvpress_program_prints_the_same_watched_and_raises_no_false_alarm(program, tmp_path, plain_python):
    directory = str(tiny_model_dir(_model_of(program)))
    plain = plain_python.run([program, directory], cwd=ROOT)  # forked from a pre-imported Python (not kvpress)
    trace = tmp_path / "run.jsonl"
    command = [sys.executable, "-m", "kvtui.cli", "watch", "--headless", "--trace", str(trace), str(program)]
    watched = subprocess.run([*command, directory], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert watched.returncode == 0, watched.stderr[-3000:]  # 1 would mean an error-level alarm
    assert watched.stdout == plain.stdout
    codes = set(re.findall(r'"code": ?"([a-z-]+)"', trace.read_text()))
    assert codes == {"cache-evicted"}, watched.stderr[-3000:]


def test_verify_between_two_forwards_of_a_press_reports_its_cost(model):
    """Verify in the middle of generate() under a press: kvtui's recompute runs without the press's hooks (set
    aside and put back), reports the compression's cost (not a mismatch), and the program's tokens are unchanged."""
    from kvpress import KnormPress

    ids = _prompt(model)
    with torch.no_grad(), KnormPress(compression_ratio=0.5)(model):
        plain = model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    results = []

    class VerifyAtStep3(Gate):
        def after_step(self, watcher, snapshot):
            if snapshot.step == 3:
                results.append(watcher.verify())

    with watch(model, gate=VerifyAtStep3()) as watcher, torch.no_grad(), KnormPress(compression_ratio=0.5)(model):
        watched = model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
        hooks = sum(len(m._forward_hooks) for m in model.modules())
    assert torch.equal(plain, watched)
    assert hooks == model.config.num_hidden_layers  # the press's hooks are back where they were
    assert len(results) == 1 and results[0]["ok"] and results[0]["compressed_kl"] > 0
    assert {d.code for d in watcher.diagnostics} == {"cache-evicted", "compression-cost"}


def _duo_attention(kp, monkeypatch):
    """DuoAttentionPress with a head pattern made here (its own comes from the DuoAttention repository or a BookSum
    run, neither reachable offline): 4 sink and 8 recent tokens, the heads scored below 0.5 streaming."""
    import numpy as np

    scores = np.array([[0.9, 0.1], [0.2, 0.8]])
    monkeypatch.setattr(kp.DuoAttentionPress, "load_attention_pattern", staticmethod(lambda model: (4, 8, scores)))
    return kp.DuoAttentionPress(head_compression_ratio=0.5)


MASKING = {
    "adakv": lambda kp, mp: kp.AdaKVPress(kp.KnormPress(compression_ratio=0.5)),
    "critical-adakv": lambda kp, mp: kp.CriticalAdaKVPress(kp.KnormPress(compression_ratio=0.5)),
    "duo-attention": _duo_attention,
}


@pytest.mark.parametrize("name", list(MASKING))
def test_masked_heads_equal_what_the_press_masked(model, name, monkeypatch):
    """A press that masks keys per head (kvpress's masked_key_indices) keeps every slot: each KV head's held
    positions are the context minus what the press masked in that head, read here from the press itself (its
    compress wrapped, the indices it left on the module copied). No position alarm (masked keys keep their slots);
    a verify in the middle leaves the masks as the press set them; the tokens are those of the run unwatched."""
    import kvpress

    ids = _prompt(model)
    with torch.no_grad(), MASKING[name](kvpress, monkeypatch)(model):
        plain = model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    press = MASKING[name](kvpress, monkeypatch)
    masked: dict[int, tuple] = {}
    original = press.compress

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        out = original(module, hidden_states, keys, values, attentions, kwargs)
        masked[module.layer_idx] = tuple(module.masked_key_indices)  # the objects the press set
        return out

    press.compress = compress
    snapshots, verified = [], []

    class VerifyAtStep2(Gate):
        def after_step(self, watcher, snapshot):
            if snapshot.step == 2:
                verified.append(watcher.verify())

    with watch(model, on_snapshot=snapshots.append, gate=VerifyAtStep2()) as watcher, torch.no_grad(), press(model):
        watched = model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert torch.equal(plain, watched)
    attention = [layer.self_attn for layer in model.model.layers]
    assert sorted(masked) == list(range(model.config.num_hidden_layers))
    # still the press's own objects on its modules (kvtui's verify prefilled in between: kvpress's patch clears them)
    assert all(all(a is b for a, b in zip(m.masked_key_indices, masked[i])) for i, m in enumerate(attention))
    assert len(verified) == 1 and verified[0]["compressed_kl"] is not None
    assert {d.code for d in watcher.diagnostics} == {"cache-evicted", "compression-cost"}, watcher.diagnostics
    assert all(d.severity == "info" for d in watcher.diagnostics)
    note = next(d for d in watcher.diagnostics if d.code == "cache-evicted")
    assert note.step == 1 and f"{type(press).__name__} masked" in note.message
    heads = model.config.num_key_value_heads
    total = 0
    for snapshot in snapshots:
        seen = snapshot.layers[0].seen
        for layer in snapshot.layers:
            batch, head, slot = (t.tolist() for t in masked[layer.index])
            gone = [{s for b, h, s in zip(batch, head, slot) if b == 0 and h == kv} for kv in range(heads)]
            expected = [set(range(seen)) - g for g in gone]
            runs = layer.held_heads or (layer.held,) * heads
            assert [{p for a, b in h for p in range(a, b)} for h in runs] == expected, (snapshot.step, layer.index)
            assert layer.filled == seen  # masked keys stay in their slots
            # what the layers pane's strip draws: the heads' mean fraction, not the slots (which stay all there)
            assert abs(layer.kept_fraction - sum(map(len, expected)) / len(expected) / seen) < 1e-9
            total += sum(len(set(range(seen)) - h) for h in expected)
    assert total > 0  # the press masked something
    assert [s.layers[0].seen for s in snapshots] == list(range(ids.shape[-1], ids.shape[-1] + 4))


def test_decoding_press_held_positions_exact_after_each_recompression(model):
    """DecodingPress re-compresses inside decoding forwards (every 3 steps, to 48 slots): after each round, and on
    every step between, each KV head's held positions equal what its compress kept, worked out here from the
    compress's own input and output (rows found by dense equality of K and V; positions carried from round to
    round, the tokens fed since appended)."""
    import kvpress

    def make():
        return kvpress.DecodingPress(kvpress.KnormPress(), compression_interval=3, target_size=48)

    ids = _prompt(model)
    with torch.no_grad(), make()(model):
        plain = model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    press = make()
    rounds: dict[int, list[tuple[int, list[list[int]]]]] = {}  # layer -> [(tokens fed, per-head positions)]
    original = press.compress

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        new_keys, new_values = original(module, hidden_states, keys, values, attentions, kwargs)
        fed = int(kwargs["cache_position"][-1]) + 1
        layer = module.layer_idx
        known, before = (rounds[layer][-1][1], rounds[layer][-1][0]) if layer in rounds else (None, 0)
        heads = keys.shape[1]
        source = [(known[h] if known else []) + list(range(before, fed)) for h in range(heads)]
        assert all(len(s) == keys.shape[2] for s in source)
        same_k = (new_keys[0][:, :, None] == keys[0][:, None]).all(-1)  # [heads, kept, input]
        same = same_k & (new_values[0][:, :, None] == values[0][:, None]).all(-1)
        assert bool((same.sum(-1) == 1).all())  # every kept row is exactly one input row
        at = same.float().argmax(-1).tolist()  # [heads][kept]
        rounds.setdefault(layer, []).append((fed, [[source[h][i] for i in at[h]] for h in range(heads)]))
        return new_keys, new_values

    press.compress = compress
    snapshots = []
    with watch(model, on_snapshot=snapshots.append) as watcher, torch.no_grad(), press(model):
        watched = model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert torch.equal(plain, watched)
    assert {d.code for d in watcher.diagnostics} == {"cache-evicted"}, watcher.diagnostics
    assert len(rounds[0]) == 2  # two rounds in 8 steps (after decoding steps 3 and 6)
    assert [d.step for d in watcher.diagnostics] == [fed - ids.shape[-1] + 1 for fed, _ in rounds[0]]
    heads = model.config.num_key_value_heads
    for snapshot in snapshots:
        for layer in snapshot.layers:
            seen = layer.seen
            done = [(fed, kept) for fed, kept in rounds[layer.index] if fed <= seen]
            if done:
                fed, kept = done[-1]
                expected = [set(k) | set(range(fed, seen)) for k in kept]
            else:
                expected = [set(range(seen))] * heads
            runs = layer.held_heads or (layer.held,) * heads if layer.held is not None else None
            got = [{p for a, b in h for p in range(a, b)} for h in runs] if runs else [set(range(seen))] * heads
            assert got == expected, (snapshot.step, layer.index)
            assert layer.filled == max(len(e) for e in expected)


def test_merging_press_says_the_merged_values(model):
    """MergingPress keeps keys as they were and folds evicted values into kept ones: kvtui places each kept slot by
    its key and says how many kept values changed, counted here from the press's own input and output."""
    import kvpress

    ids = _prompt(model)
    press = kvpress.MergingPress(kvpress.KnormPress(compression_ratio=0.5))
    kept: dict[int, list[set[int]]] = {}
    merged = [0]
    original = press.compress

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        new_keys, new_values = original(module, hidden_states, keys, values, attentions, kwargs)
        same = (new_keys[0][:, :, None] == keys[0][:, None]).all(-1)  # [heads, kept, input]: keys are kept as written
        at = same.float().argmax(-1)
        kept[module.layer_idx] = [set(row) for row in at.tolist()]
        source = values[0].gather(1, at.unsqueeze(-1).expand(-1, -1, values.shape[-1]))
        merged[0] += int((source != new_values[0]).any(-1).sum())
        return new_keys, new_values

    press.compress = compress
    snapshots = []
    with watch(model, on_snapshot=snapshots.append) as watcher, torch.no_grad(), press(model):
        model.generate(ids, max_new_tokens=2, do_sample=False, min_new_tokens=2)
    assert merged[0] > 0
    assert {d.code for d in watcher.diagnostics} == {"cache-evicted"}, watcher.diagnostics
    assert f"; {merged[0]} kept values changed (merged)" in watcher.diagnostics[0].message
    for layer in snapshots[0].layers:
        runs = layer.held_heads or (layer.held,) * len(kept[layer.index])
        assert [{p for a, b in h for p in range(a, b)} for h in runs] == kept[layer.index]


def test_masked_keys_cost_no_device_read_of_their_own(model):
    """Under AdaKVPress every watched step still reads the device once: the masks the prefill set ride its one
    transfer, and decoding steps (the same masks) read nothing more. Counted from kvtui's frames only (the device
    reads of torch methods called by kvtui's code; kvpress's and generate()'s own are not kvtui's)."""
    import os

    import kvpress

    import kvtui

    kvtui_dir = os.path.dirname(os.path.abspath(kvtui.__file__)) + os.sep
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    here = os.path.abspath(__file__)
    seen: list[str] = []
    undo = []

    def from_kvtui() -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_code.co_filename
            if not name.startswith(torch_dir) and name != here:
                return name.startswith(kvtui_dir)
            frame = frame.f_back
        return False

    for name in ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            if from_kvtui():
                seen.append(_name)
            return _original(*args, **kwargs)

        undo.append((name, original))
        setattr(torch.Tensor, name, counted)
    per_step: list[list[str]] = []

    def on_snapshot(snapshot):
        per_step.append(list(seen))
        seen.clear()

    press = kvpress.AdaKVPress(kvpress.KnormPress(compression_ratio=0.5))
    try:
        with watch(model, on_snapshot=on_snapshot) as watcher, torch.no_grad(), press(model):
            model.generate(_prompt(model), max_new_tokens=4, do_sample=False, min_new_tokens=4)
    finally:
        for name, original in undo:
            setattr(torch.Tensor, name, original)
    assert "AdaKVPress masked" in watcher.diagnostics[0].message  # the masks were read (in the prefill's transfer)
    assert per_step == [["tolist"]] * 4


def test_verify_with_attention_says_what_the_recompute_looks_at_among_the_evicted(model):
    """With --attention, verify on a compressed cache says, per layer, the share of the newest query's attention
    that the uncompressed recompute puts on the positions the press evicted: worked out here from an eager copy of
    the model's own attention weights over the same tokens and the positions the press's compress kept."""
    from kvpress import KnormPress

    ids = _prompt(model)
    press = KnormPress(compression_ratio=0.5)
    kept = _kept_by_press(press)
    results = []

    class VerifyAtStep3(Gate):
        def after_step(self, watcher, snapshot):
            if snapshot.step == 3:
                results.append(watcher.verify())

    with watch(model, gate=VerifyAtStep3(), attention=True) as watcher, torch.no_grad(), press(model):
        watched = model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    (result,) = results
    shares = result["evicted_attention"]
    assert len(shares) == model.config.num_hidden_layers and all(s is not None for s in shares)
    n = ids.shape[-1] + 2  # after step 3: the prompt and the two tokens fed by steps 2 and 3
    eager = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("tiny:llama"), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        weights = eager(input_ids=watched[:, :n], output_attentions=True).attentions  # per layer [1, heads, n, n]
    for layer, (share, attention) in enumerate(zip(shares, weights, strict=True)):
        row = attention[0, :, -1, :]  # [heads, n]
        group = row.shape[0] // len(kept[layer])
        outside = [
            sum(float(row[h, p]) for p in range(n) if p < ids.shape[-1] and p not in kept[layer][h // group])
            for h in range(row.shape[0])
        ]
        assert abs(share - sum(outside) / len(outside)) < 1e-4, (layer, share, outside)
    assert max(shares) > 0.0  # the press evicted what the model looks at, a little at least
    cost = next(d for d in watcher.diagnostics if d.code == "compression-cost")
    assert "of the newest query's attention on the evicted positions" in cost.message

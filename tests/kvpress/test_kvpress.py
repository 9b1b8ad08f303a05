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

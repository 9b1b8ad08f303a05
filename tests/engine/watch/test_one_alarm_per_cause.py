"""One alarm per cause: once a cause is named for a cache in a generate() call, the forwards of that call it
goes on affecting are not re-explained with another, wrong reason. The reported case is assisted decoding on
a copied prefix cache: the assistant's own generate() calls, nested in the model's, ran between the model's
verify forwards, and each verify forward was taken for the first forward of a new generate() (its prompt
checked again against a cache that by then held the generated text: "N prompt token(s) were never fed").
A real second cause on the same cache (a second generate() call) is still named."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from plain_python import run_kvtui
from transformers import AutoModelForCausalLM, DynamicCache

from kvtui.engine.records.diagnostic_groups import group_diagnostics
from kvtui.engine.records.snapshot import Diagnostic
from kvtui.engine.watch.probe import watch
from program_headers import expected_codes, header, model_dir

ROOT = Path(__file__).resolve().parents[3]
PROGRAM = ROOT / "tests" / "watch_corpus" / "assisted_prefix_cache.py"
TRUE_CAUSE = "repeat the cache's own start: the model sees them twice"


def test_assisted_decoding_on_a_copied_prefix_cache_is_one_stale_cache_group(tmp_path):
    trace = tmp_path / "run.jsonl"
    command = ["watch", "--headless", "--trace", str(trace), str(PROGRAM)]
    directory = str(model_dir(header(PROGRAM, "kvtui-model")))
    result = run_kvtui(*command, directory, cwd=ROOT)  # a pre-imported Python (tests/plain_python.py)
    assert result.returncode == 0, result.stderr[-3000:]
    found = [
        Diagnostic(d["code"], d["severity"], d["message"], record["step"])
        for record in map(json.loads, trace.read_text().splitlines())
        if record["type"] == "step"
        for d in record["diagnostics"]
    ]
    assert {d.code for d in found} == expected_codes(PROGRAM) == {"stale-cache"}
    line = next(n for n, text in enumerate(PROGRAM.read_text().splitlines(), 1) if "model.generate(" in text)
    at = f"[tests/watch_corpus/{PROGRAM.name}:{line}]"
    assert len({d.message for d in found}) == 1 and TRUE_CAUSE in found[0].message and at in found[0].message
    assert "never fed" not in result.stdout + result.stderr
    groups = group_diagnostics(found)
    assert [(g.code, g.cache) for g in groups] == [("stale-cache", "DynamicCache#2")]
    # the headless summary: one stale-cache line, the true message, no "last, step N:" re-explanation
    summary = [text for text in result.stderr.splitlines() if "stale-cache" in text]
    assert len(summary) == 1 and TRUE_CAUSE in summary[0], result.stderr[-3000:]
    assert "last, step" not in result.stderr


def test_a_second_generate_on_the_same_cache_is_still_named(tiny_model, tiny_dir):
    """The first assisted generate() re-feeds the cached prefix (one alarm); a second generate() on the same
    cache with another prompt continues the first call's text: a second cause, named at its own call."""
    model, tok = tiny_model("llama")
    draft = AutoModelForCausalLM.from_pretrained(str(tiny_dir("llama")), dtype=torch.float32, num_hidden_layers=1)
    prefix = tok("you are a helpful assistant that answers in short words.", return_tensors="pt").input_ids
    with watch(model, tok) as watcher:
        prefix_cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=prefix, past_key_values=prefix_cache)
        cache = copy.deepcopy(prefix_cache)
        doubled = torch.cat([prefix, prefix, tok(" count to 9: 1, 2,", return_tensors="pt").input_ids], dim=-1)
        model.generate(doubled, past_key_values=cache, assistant_model=draft, max_new_tokens=8, do_sample=False)
        first = len(watcher.diagnostics)
        # longer than what the cache holds: 4.57's generate() slices the prompt by the cache's length (a shorter
        # one raises IndexError inside transformers, watched or not)
        other = tok(" ".join(["a dog ran in the park and then went home to eat"] * 8), return_tensors="pt").input_ids
        assert other.shape[1] > cache.get_seq_length()
        model.generate(other, past_key_values=cache, assistant_model=draft, max_new_tokens=4, do_sample=False)
    stale = [d for d in watcher.diagnostics if d.code == "stale-cache"]
    assert len(stale) == 2 and len({d.message for d in stale}) == 2, watcher.diagnostics
    assert TRUE_CAUSE in stale[0].message and stale[0] in watcher.diagnostics[:first]
    assert "not a prefix of the prompt" in stale[1].message and stale[1] in watcher.diagnostics[first:]
    assert all("test_one_alarm_per_cause.py:" in d.message for d in stale)

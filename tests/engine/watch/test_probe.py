"""kvtui.watch on someone else's loop: every watched step equals an independent recomputation
(applied positions, cache length, per-layer shapes, top-k probabilities), alarms name the caller's
line, and detaching leaves the model exactly as it was."""

import copy
import json
from dataclasses import replace

import pytest
import torch
from transformers import DynamicCache, StaticCache

from kvtui.engine.reading import introspect
from kvtui.engine.watch.probe import watch

ARCHES = [
    ("llama", {}),  # GQA (2 KV heads for 4 query heads)
    ("qwen2", {}),
    ("gemma3", {"sliding_window": 8}),  # sliding + full layers, evicting
    ("gpt2", {}),  # learned absolute positions: read at wpe
]
PROMPT = "Let's start by defining a variable k equal to 5. What is k?"


def full_probs(model, ids, mask=None):
    """An independent recomputation: one no-cache forward over everything fed so far -> probs [batch, vocab]."""
    kwargs = {}
    if mask is not None:  # left padding: positions count attended tokens only, as generate does
        kwargs = {"attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    with torch.inference_mode():
        return torch.softmax(model(input_ids=ids, use_cache=False, **kwargs).logits[:, -1].float(), -1)


def check_layers(snapshot, cache):
    assert len(snapshot.layers) == len(cache.layers)
    for info, layer in zip(snapshot.layers, cache.layers):
        assert info.k_shape == tuple(layer.keys.shape) and info.v_shape == tuple(layer.values.shape)


def check_topk(snapshot_topk, probs_row):
    top = torch.topk(probs_row, 3)
    assert [t.id for t in snapshot_topk[:3]] == top.indices.tolist()
    assert [t.prob for t in snapshot_topk[:3]] == pytest.approx(top.values.tolist(), abs=1e-5)


@pytest.mark.parametrize("arch,kwargs", ARCHES, ids=[a for a, _ in ARCHES])
def test_hand_written_loop_matches_recompute(tiny_model, arch, kwargs):
    model, tokenizer = tiny_model(arch, **kwargs)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]  # [1, n]
    snapshots = []
    with watch(model, tokenizer, on_snapshot=snapshots.append) as watcher:
        cache = DynamicCache(config=model.config)
        fed = ids
        with torch.inference_mode():
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            for _ in range(12):
                token = out.logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
                fed = torch.cat([fed, token], dim=-1)
                out = model(input_ids=token, past_key_values=cache, use_cache=True)
                snapshot = snapshots[-1]
                length = fed.shape[1]
                assert snapshot.positions == (length - 1,)  # applied, read at the position module
                assert snapshot.cache_length_before == length - 1
                assert snapshot.cache_seq_length == int(cache.get_seq_length()) == length
                assert snapshot.buffer.ids() == fed[0].tolist()
                check_layers(snapshot, cache)
                check_topk(snapshot.topk, full_probs(model, fed)[0])
    assert snapshots[0].phase == "prefill" and snapshots[0].positions == tuple(range(ids.shape[1]))
    assert snapshots[0].positions_source == ("embedding" if arch == "gpt2" else "rotary")
    assert all(s.caller.endswith(f"test_probe.py:{s.caller.rsplit(':', 1)[1]}") for s in snapshots)
    assert {d.code for d in watcher.diagnostics} <= {"sliding-eviction"}, watcher.diagnostics
    if arch == "gemma3":
        assert any(d.code == "sliding-eviction" for d in watcher.diagnostics)


@pytest.mark.parametrize("arch,kwargs", ARCHES, ids=[a for a, _ in ARCHES])
def test_generate_matches_recompute(tiny_model, arch, kwargs):
    model, tokenizer = tiny_model(arch, **kwargs)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    snapshots = []
    with watch(model, tokenizer, on_snapshot=snapshots.append) as watcher:
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id or 0)
    assert len(snapshots) == out.shape[1] - ids.shape[1]  # one forward per new token (the last is not fed)
    for index, snapshot in enumerate(snapshots):
        length = ids.shape[1] + index  # tokens in the cache after this forward
        assert snapshot.cache_seq_length == length
        assert snapshot.buffer.ids() == out[0, :length].tolist()
        assert snapshot.positions[-1] == length - 1
        check_topk(snapshot.topk, full_probs(model, out[:, :length])[0])
        if index:
            assert snapshot.input_ids == (int(out[0, length - 1]),)
    assert snapshots[-1].caller.split(":")[0].endswith("test_probe.py")  # the generate() line, not transformers
    assert {d.code for d in watcher.diagnostics} <= {"sliding-eviction"}, watcher.diagnostics


def test_left_padded_batch_generate_rows(tiny_model):
    model, tokenizer = tiny_model("llama")
    tokenizer.padding_side = "left"
    texts = ["hello world", "What is the capital of France? Tell me"]
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    pad = tokenizer.pad_token_id
    snapshots = []
    try:
        with watch(model, tokenizer, on_snapshot=snapshots.append) as watcher:
            out = model.generate(**enc, max_new_tokens=5, do_sample=False, pad_token_id=pad)
    finally:
        tokenizer.padding_side = "right"
    first, last = snapshots[0], snapshots[-1]
    assert first.batch == 2 and len(first.rows) == 2
    short = first.rows[0]
    n_pads = int((enc["attention_mask"][0] == 0).sum())
    assert n_pads > 0 and [t.origin for t in short.buffer[:n_pads]] == ["pad"] * n_pads
    assert all(t.origin == "fed" for t in short.buffer[n_pads:])
    # every row's top-k equals a full forward with the same mask and positions
    length = last.cache_seq_length
    mask = torch.cat([enc["attention_mask"], torch.ones(2, length - enc["input_ids"].shape[1], dtype=torch.long)], -1)
    probs = full_probs(model, out[:, :length], mask)
    for row in range(2):
        assert last.rows[row].buffer.ids() == out[row, :length].tolist()
        check_topk(last.rows[row].topk, probs[row])
        assert last.for_row(row).topk == last.rows[row].topk
    assert last.rows[0].positions == (length - 1 - n_pads,)  # counted over attended tokens only
    assert {d.code for d in watcher.diagnostics} == set(), watcher.diagnostics  # masked pads are no alarm


def test_static_cache_and_overflow(tiny_model):
    model, tokenizer = tiny_model("llama")
    ids = tokenizer("hello world foo bar", return_tensors="pt")["input_ids"]
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 2)
    with watch(model, tokenizer) as watcher:
        with torch.inference_mode():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            token = torch.tensor([[5]])
            model(input_ids=token, past_key_values=cache, use_cache=True)
            model(input_ids=token, past_key_values=cache, use_cache=True)
            with pytest.raises(IndexError):
                model(input_ids=token, past_key_values=cache, use_cache=True)
    assert watcher.last.capacity == ids.shape[1] + 2
    assert watcher.last.cache_seq_length == ids.shape[1] + 2
    assert all(layer.filled == ids.shape[1] + 2 for layer in watcher.last.layers)
    codes = [(d.code, d.severity) for d in watcher.diagnostics]
    # a program sizes its own static cache (generate() sizes it exactly): filling it is not news, overflowing it is
    assert ("static-capacity", "warning") not in codes and ("static-capacity", "error") in codes
    overflow = next(d for d in watcher.diagnostics if d.severity == "error")
    assert "1 too many" in overflow.message and "test_probe.py:" in overflow.message


def test_primed_pads_and_own_cursor(tiny_model):
    """The motivating bug: a cache primed with pads, a private cursor passed as cache_position."""
    model, tokenizer = tiny_model("llama")
    pad = tokenizer.pad_token_id
    with watch(model, tokenizer) as watcher:
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=torch.full((1, 16), pad), past_key_values=cache, use_cache=True)
            cp = 0
            ids = tokenizer("hello world", return_tensors="pt")["input_ids"]
            model(
                input_ids=ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(cp, cp + ids.shape[1])
            )
    codes = {d.code for d in watcher.diagnostics}
    if introspect.forward_accepts(model, "cache_position"):  # 4.x: the passed cursor drives the positions
        assert {"pad-in-cache", "cursor-mismatch", "position-gap"} <= codes and "ignored-argument" not in codes, codes
        gap = next(d for d in watcher.diagnostics if d.code == "position-gap")
        assert "applied at position 0 but 16 attended tokens precede it" in gap.message, gap.message
        assert watcher.last.positions[-1] == ids.shape[1] - 1  # the program's cursor, not the cache's length
    else:  # 5.4+: ignored; the model took its positions from the cache's length
        assert {"pad-in-cache", "cursor-mismatch", "ignored-argument"} <= codes and "position-gap" not in codes, codes
        assert watcher.last.positions[-1] == 16 + ids.shape[1] - 1
    mismatch = next(d for d in watcher.diagnostics if d.code == "cursor-mismatch")
    assert "holds 16 tokens" in mismatch.message and "test_probe.py:" in mismatch.message
    assert watcher.last.cursor == ids.shape[1] and watcher.last.cache_seq_length == 16 + ids.shape[1]


def test_position_gap_from_explicit_positions(tiny_model):
    model, tokenizer = tiny_model("qwen2")
    with watch(model, tokenizer) as watcher:
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=torch.tensor([[5, 6, 7]]), past_key_values=cache)
            model(input_ids=torch.tensor([[8]]), past_key_values=cache, position_ids=torch.tensor([[0]]))
    gap = [d for d in watcher.diagnostics if d.code == "position-gap"]
    assert len(gap) == 1 and "applied at position 0 but 3 attended tokens precede it" in gap[0].message
    assert watcher.last.positions == (0,) and watcher.last.requested_positions == (0,)


def test_cache_edits_are_named(tiny_model):
    model, tokenizer = tiny_model("llama")
    with watch(model, tokenizer) as watcher:
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=torch.tensor([[5, 6, 7, 8]]), past_key_values=cache)
            cache.crop(-1)  # a named method: caught as it happens
            model(input_ids=torch.tensor([[9]]), past_key_values=cache)
            cache.layers[0].keys[:, :, -1] = 0  # a raw in-place write: caught at the next forward
            model(input_ids=torch.tensor([[10]]), past_key_values=cache)
    edits = [d for d in watcher.diagnostics if d.code == "cache-edited"]
    assert len(edits) == 2, edits
    assert "crop(-1)" in edits[0].message and "4 -> 3 tokens" in edits[0].message
    assert "edited in place in 1 of 2 layers (0)" in edits[1].message
    assert watcher.last.buffer.ids() == [5, 6, 7, 9, 10]  # the cropped token left the buffer too


def test_tokenizer_added_eos_and_trace(tiny_model, tmp_path):
    """The hidden EOS: tokenizer defaults append one the text does not contain (prompt 862, cache 863)."""
    model, tokenizer = tiny_model("llama", eos=True)
    trace = tmp_path / "run.jsonl"
    with watch(model, tokenizer, trace=trace) as watcher:
        ids = tokenizer("hello world", return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            model(input_ids=ids, use_cache=True)
    codes = {d.code for d in watcher.diagnostics}
    assert codes == {"tokenizer-added-special", "eos-in-context"}, watcher.diagnostics
    assert watcher.last.buffer[-1].origin == "tokenizer-added"
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert records[0]["type"] == "header" and records[0]["source"] == "watch"
    step = next(r for r in records if r["type"] == "step")
    assert step["source"] == "watch" and step["caller"].startswith("tests") and step["cache_id"] == "DynamicCache#1"
    assert {d["code"] for d in step["diagnostics"]} == codes


def test_watching_leaves_no_hook_and_detach_restores_every_class(tiny_model):
    """The probe keeps nothing on the model or the cache (no hooks, no instance attributes: they would travel
    with deepcopy and pickle); it patches classes, and detach gives each class back its own __dict__."""
    model, tokenizer = tiny_model("llama")
    hooks = lambda: sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())  # noqa: E731
    before = hooks()
    classes = {
        cls: dict(vars(cls))
        for cls in {
            type(model),
            DynamicCache,
            *DynamicCache.__mro__,
            *(type(m) for m in model.modules()),
            type(tokenizer),
            *type(tokenizer).__mro__,
        }
    }
    ids = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():
        reference = model(input_ids=ids).logits
    cache = DynamicCache(config=model.config)
    cache_attributes = set(vars(cache))
    with watch(model, tokenizer) as watcher:
        with torch.inference_mode():
            model(input_ids=ids, past_key_values=cache)
        assert watcher.steps == 1 and hooks() == before
        assert not [
            name
            for name, value in vars(cache).items()
            if name not in cache_attributes and getattr(value, "__module__", "").startswith("kvtui")
        ]  # nothing of kvtui on the instance
        patched = [cls for cls, attributes in classes.items() if dict(vars(cls)) != attributes]
        assert type(model) in patched and DynamicCache in patched
    assert hooks() == before
    assert not [
        vars(cache)[name]
        for name in vars(cache)
        if callable(vars(cache)[name]) and getattr(vars(cache)[name], "__module__", "").startswith("kvtui")
    ]
    for cls, attributes in classes.items():
        now = dict(vars(cls))
        assert now.keys() == attributes.keys(), cls
        assert all(now[k] is attributes[k] for k in attributes if k != "__dict__"), cls
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, reference)


def test_replay_reads_watched_trace(tiny_model, tmp_path):
    from kvtui.engine.records.replay import Replay
    from kvtui.engine.records.trace import read_trace

    model, tokenizer = tiny_model("llama")
    trace = tmp_path / "gen.jsonl"
    snapshots = []
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(["hi", "hello world foo"], return_tensors="pt", padding=True)
        with watch(model, tokenizer, trace=trace, on_snapshot=snapshots.append):
            model.generate(**enc, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    finally:
        tokenizer.padding_side = "right"
    replay = Replay(read_trace(trace))
    assert len(replay) == len(snapshots)
    for live, replayed in zip(snapshots, replay.snapshots):
        # every compared field, watch fields included (timings are rounded in the trace)
        assert replayed == replace(live, forward_ms=replayed.forward_ms, snapshot_ms=replayed.snapshot_ms)
        assert replayed.buffer.ids() == live.buffer.ids()
        for row in range(2):
            assert replayed.rows[row].buffer.ids() == live.rows[row].buffer.ids()


def test_beam_search_rows_follow_reorders(tiny_model):
    """generate(num_beams=2): one buffer per beam row; generate's own reorders are followed, not alarms."""
    model, tokenizer = tiny_model("llama")
    ids = tokenizer("hello world", return_tensors="pt")["input_ids"]
    snapshots = []
    with watch(model, tokenizer, on_snapshot=snapshots.append) as watcher:
        out = model.generate(
            ids,
            max_new_tokens=4,
            num_beams=2,
            do_sample=False,
            early_stopping=False,
            pad_token_id=tokenizer.pad_token_id,
            return_dict_in_generate=True,
        )
    last = snapshots[-1]
    assert last.batch == 2 and len(last.rows) == 2
    assert all(len(r.buffer) == last.cache_seq_length for r in last.rows)
    assert all(r.buffer.ids()[: ids.shape[1]] == ids[0].tolist() for r in last.rows)
    # the winning beam's tokens are one of the rows' buffers (plus the final token, never fed)
    best = out.sequences[0].tolist()
    assert any(r.buffer.ids() == best[: len(r.buffer)] for r in last.rows)
    assert {d.code for d in watcher.diagnostics} == set(), watcher.diagnostics


def test_pipeline_is_watched(tiny_dir):
    from transformers import pipeline

    from kvtui.engine.watch.probe import AutoAttach, Watcher

    watcher = Watcher()
    attach = AutoAttach(watcher).install()
    try:
        pipe = pipeline("text-generation", model=str(tiny_dir("qwen2")), device="cpu")
        pipe("hello world", max_new_tokens=3, do_sample=False)
    finally:
        attach.uninstall()
        watcher.detach()
    assert len(watcher.probes) == 0 and watcher.steps == 3  # prefill + 2 decodes (the last token is not fed)
    assert watcher.last.caller.split(":")[0].endswith("test_probe.py")
    assert watcher.tokenizer is not None and watcher.last.buffer[0].piece == watcher.tokenizer.decode(
        [watcher.last.buffer[0].id]
    )


def test_verify_between_forwards(tiny_model):
    model, tokenizer = tiny_model("qwen2")
    with watch(model, tokenizer) as watcher:
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=torch.tensor([[5, 6, 7, 8]]), past_key_values=cache)
            model(input_ids=torch.tensor([[9]]), past_key_values=cache)
        good = watcher.verify()
        with torch.inference_mode():
            cache.layers[0].values.mul_(0.5)  # corrupt the cache, then feed through it
            model(input_ids=torch.tensor([[10]]), past_key_values=cache)
        bad = watcher.verify()
    assert good["ok"] and good["tokens"] == 5 and good["max_abs_diff"] < 1e-4
    assert not bad["ok"] and bad["tokens"] == 6
    assert {"cache-edited", "cache-mismatch"} <= {d.code for d in watcher.diagnostics}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_reads_the_logits_as_the_forward_returned_them(tiny_model, dtype):
    """What verify compares is a copy of the forward's last logits (for a model in another dtype: the top-k's own
    float32 copy): a program that edits its logits in place after the forward (a ban, a penalty) changes nothing."""
    shared, tokenizer = tiny_model("llama")
    model = copy.deepcopy(shared).to(dtype)  # the fixture's model is shared by the session's tests: left float32
    with watch(model, tokenizer) as watcher:
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=torch.tensor([[5, 6, 7, 8]]), past_key_values=cache)
            out = model(input_ids=torch.tensor([[9]]), past_key_values=cache)
            expected = out.logits[0, -1].float().clone()
            out.logits[:, -1, :] = -1e4  # the program bans everything, in place
        assert torch.equal(watcher._last_logits, expected)
        result = watcher.verify()
    assert result["ok"] and result["tokens"] == 5, result


def test_in_place_write_in_the_middle_is_caught_under_no_grad(tiny_model):
    """Outside inference mode the cache tensors count their in-place writes: any slot, any layer."""
    model, tokenizer = tiny_model("llama")
    with watch(model, tokenizer) as watcher:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), past_key_values=cache)
            cache.layers[1].values[:, :, 2] += 1.0  # the middle of layer 1
            model(input_ids=torch.tensor([[10]]), past_key_values=cache)
            model(input_ids=torch.tensor([[11]]), past_key_values=cache)  # nothing edited before this one
    edits = [d for d in watcher.diagnostics if d.code == "cache-edited"]
    assert len(edits) == 1 and edits[0].step == 2, edits
    assert "edited in place in 1 of 2 layers (1)" in edits[0].message


@pytest.mark.parametrize("detach_first", [False, True])
def test_the_probe_keeps_no_discarded_cache_alive(tiny_model, detach_first):
    """A cache's fingerprint holds its K/V (views and references, for the check at the next forward): a
    cache the program drops is freed at once, watched or after detach, as it would be unwatched."""
    import gc
    import weakref

    model, tokenizer = tiny_model("llama")
    watcher = watch(model, tokenizer)
    try:
        for mode in (torch.inference_mode, torch.no_grad):  # end-slot views / write counters
            cache = DynamicCache(config=model.config)
            with mode():
                model(input_ids=torch.tensor([[5, 6, 7, 8]]), past_key_values=cache)
                model(input_ids=torch.tensor([[9]]), past_key_values=cache)
            keys = weakref.ref(cache.layers[0].keys)
            if detach_first:
                watcher.detach()
            del cache
            gc.collect()
            assert keys() is None, f"{mode.__name__}: the discarded cache's keys are still alive"
            if detach_first:
                break
    finally:
        watcher.detach()


@pytest.mark.parametrize("arch", ["qwen3_next", "lfm2", "falcon_h1", "jamba"])
def test_hybrid_is_watched_or_refused_in_one_line(tiny_model, arch):
    """Where this transformers' DynamicCache holds the hybrid's conv/SSM layers (5.x), its generate() is watched
    with no alarm; where the model keeps them in its own cache class (4.57, whose lengths kvtui would misread:
    Jamba's gave a false cursor-mismatch and position-gap), watching it is refused in one line."""
    from kvtui.engine.watch.probe import WatchRefused

    model, tokenizer = tiny_model(arch)
    ids = tokenizer("hello world", return_tensors="pt")
    keeps_state = any(hasattr(layer, "conv_states") for layer in DynamicCache(config=model.config).layers)
    if not keeps_state:
        with pytest.raises(WatchRefused, match="cannot inspect this hybrid here") as caught:
            watch(model, tokenizer)
        assert "\n" not in str(caught.value)
        return
    with watch(model, tokenizer) as watcher:
        with torch.inference_mode():
            out = model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert watcher.diagnostics == [], watcher.diagnostics
    assert watcher.last.cache_seq_length == out.shape[1] - 1 == len(watcher.last.buffer)


def test_watched_program_with_a_refused_hybrid_runs_on(tiny_dir, tmp_path):
    """`kvtui watch` of a program that builds a hybrid: watched, or one line and the program runs unwatched."""
    import subprocess
    import sys

    path = tiny_dir("jamba")
    script = tmp_path / "hybrid.py"
    script.write_text(
        "import sys, torch\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "tok = AutoTokenizer.from_pretrained(sys.argv[1]); model = AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
        "out = model.generate(**tok('hello world', return_tensors='pt'), max_new_tokens=3, do_sample=False)\n"
        "print('generated', out.shape[1])\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "kvtui.cli", "watch", "--headless", str(script), str(path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("generated ")
    from transformers import AutoConfig

    keeps_state = any(
        hasattr(layer, "conv_states") for layer in DynamicCache(config=AutoConfig.from_pretrained(str(path))).layers
    )
    refusals = [line for line in run.stderr.splitlines() if line.startswith("kvtui watch: not watching")]
    if keeps_state:
        assert refusals == [] and "3 forwards watched" in run.stderr, run.stderr[-2000:]
    else:
        assert len(refusals) == 1 and "cannot inspect this hybrid here" in refusals[0], run.stderr[-2000:]
        assert "0 forwards watched" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("tokenizer_first", [True, False])
def test_two_model_families_in_one_program_each_read_with_its_own_tokenizer(tiny_dir, tokenizer_first):
    """A program that runs a Llama and then a Qwen2 (an eval sweep): the same id is a different piece in
    each vocabulary, so every piece (fed tokens and top-k) must come from the tokenizer loaded with the
    model that ran. Before, the first tokenizer read both (Qwen2's "The capital" showed as "qual ays").
    Models and tokenizers load in either order, as programs do."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvtui.engine.watch.probe import AutoAttach, Watcher

    snapshots = []
    watcher = Watcher(on_snapshot=snapshots.append)
    attach = AutoAttach(watcher).install()
    tokenizers = []
    try:
        for arch in ("llama", "qwen2"):
            path = str(tiny_dir(arch))
            if tokenizer_first:
                tok = AutoTokenizer.from_pretrained(path)
                model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            else:
                model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
                tok = AutoTokenizer.from_pretrained(path)
            tokenizers.append(tok)
            ids = tok("The capital of France is", return_tensors="pt")
            model.generate(**ids, max_new_tokens=3, do_sample=False)
    finally:
        attach.uninstall()
        watcher.detach()
    assert tokenizers[0]("The capital")["input_ids"] != tokenizers[1]("The capital")["input_ids"]  # two vocabs
    assert len(snapshots) == 6
    for index, snapshot in enumerate(snapshots):
        tok = tokenizers[index // 3]
        fed = snapshot.buffer[len(snapshot.buffer) - len(snapshot.input_ids) :]
        assert [t.piece for t in fed] == [tok.decode([i], skip_special_tokens=False) for i in snapshot.input_ids]
        assert [t.text for t in snapshot.topk] == [tok.decode([t.id], skip_special_tokens=False) for t in snapshot.topk]
    assert "".join(t.piece for t in snapshots[3].buffer).endswith("The capital of France is")


def test_a_relative_trace_path_is_where_it_pointed_when_the_watch_began(tiny_model, tmp_path, monkeypatch):
    """The trace file opens at the first forward: a program (or notebook) that changed folder since `watch()` still
    gets its trace where the path pointed then."""
    model, tokenizer = tiny_model("llama")
    (tmp_path / "later").mkdir()
    monkeypatch.chdir(tmp_path)
    with watch(model, tokenizer, trace="run.jsonl"):
        monkeypatch.chdir(tmp_path / "later")
        with torch.inference_mode():
            model(input_ids=torch.tensor([[1, 2, 4]]), use_cache=True)
    assert (tmp_path / "run.jsonl").exists() and not (tmp_path / "later" / "run.jsonl").exists()


def test_a_cache_method_that_raises_shows_one_frame_of_kvtui_and_kvtuis_failure_never_breaks_it(
    tiny_model, monkeypatch
):
    """A cache's own edit method runs from kvtui's wrapper frame itself: the program's traceback through it holds
    one frame of kvtui's (it held four), and a failure of kvtui's while following the edit is a worker-error of
    kvtui's, never the program's exception."""
    import traceback

    from kvtui.engine.watch import cache_edits

    model, tokenizer = tiny_model("llama")
    cache = DynamicCache()
    with watch(model, tokenizer) as watcher:
        with torch.inference_mode():
            model(input_ids=torch.tensor([[1, 2, 4, 5]]), past_key_values=cache, use_cache=True)
        with pytest.raises(IndexError) as raised:
            cache.batch_select_indices(torch.tensor([3]))  # a batch of one has no row 3
        kvtui_frames = [f for f in traceback.extract_tb(raised.value.__traceback__) if "kvtui" in f.filename]
        assert [f.name for f in kvtui_frames] == ["wrapper"]

        def broken(*args):
            raise RuntimeError("kvtui's own bug")

        monkeypatch.setattr(cache_edits, "edit_ended", broken)
        cache.crop(-1)  # the program's call: done, whatever kvtui's bookkeeping does
        assert cache.get_seq_length() == 3
    assert any("following crop()" in e and "kvtui's own bug" in e for e in watcher.errors), watcher.errors


def test_a_trace_that_cannot_be_opened_leaves_the_steps_watched(tiny_model, tmp_path):
    """A trace file that cannot be opened at the first forward (its folder is a file, a full disk...) is one
    worker-error of kvtui's; the forwards are still watched and counted."""
    model, tokenizer = tiny_model("llama")
    (tmp_path / "a_file").write_text("")
    with watch(model, tokenizer, trace=tmp_path / "a_file" / "run.jsonl") as watcher:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([[1, 2, 4]]), use_cache=True)
            model(input_ids=torch.tensor([[5]]), past_key_values=out.past_key_values, use_cache=True)
    assert watcher.steps == 2 and watcher.last.cache_seq_length == 4
    assert [e for e in watcher.errors if "opening the trace" in e], watcher.errors


def test_watching_a_watched_model_again_hands_it_to_the_newer_watch(tiny_model):
    """A notebook cell run twice: the newer `watch()` sees the model's forwards from then on (the earlier one says
    why it no longer does), and detaching the earlier one leaves the newer one watching (it removed the newer one's
    registry entries before: both went silent); detaching both leaves the class as it was."""
    model, tokenizer = tiny_model("llama")
    call_before = type(model).__call__

    def forward(text):
        with torch.inference_mode():
            model(**tokenizer(text, return_tensors="pt"), use_cache=True)

    first = watch(model, tokenizer)
    forward("a")
    second = watch(model, tokenizer)
    forward("b")
    assert (first.steps, second.steps) == (1, 1)
    assert any("newer kvtui.watch()" in line for line in first.refused), first.refused
    first.detach()
    forward("c")
    assert second.steps == 2 and second.last.positions == tuple(range(len(second.last.positions)))
    second.detach()
    forward("d")
    assert (first.steps, second.steps) == (1, 2)
    assert type(model).__call__ is call_before

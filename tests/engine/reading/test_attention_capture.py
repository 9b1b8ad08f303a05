"""Attention capture (kvtui/engine/reading/attention.py): every layer's newest-query weights, recorded around
whatever attention implementation the model uses, checked against eager attention's `output_attentions` over
the same tokens (an independent computation: a full forward, no cache), and invisible to the program."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

import kvtui
from kvtui.engine.models.tiny import MATRIX_ARCHES
from kvtui.engine.reading import attention as capture_module
from kvtui.engine.reading import introspect
from kvtui.engine.records.codec import from_record, step_record  # noqa: F401  (round trip below)

TEXT = "The attention layer reads the keys and values of earlier tokens. Sliding window attention only keeps"


def through_interface(model) -> bool:
    """Whether the model's modeling code calls transformers' attention interface at all (Falcon calls torch's
    scaled_dot_product_attention itself; StableLM too on 4.57): read from its source, not from kvtui."""
    return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(sys.modules[type(model).__module__])


def watchable(model) -> None:
    refusal = introspect.hybrid_refusal(model.config)
    if refusal:  # 4.57 keeps a hybrid's conv/SSM state in its own cache class: kvtui refuses to watch it there
        pytest.skip(refusal)


def eager_rows(directory, ids: torch.Tensor, mask: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Eager attention's head-mean row of the newest query per attention layer, batch row 0: [positions] each."""
    eager = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        out = eager(input_ids=ids, attention_mask=mask, output_attentions=True)
    return [a[0, :, -1, :].mean(dim=0) for a in out.attentions]


def check_contract(attention, references: list[torch.Tensor], total: int) -> None:
    """`attention` (one entry per layer, None where no attention) against eager's rows of the attention layers."""
    held = [i for i, entry in enumerate(attention) if entry is not None]
    assert len(held) == len(references), (held, len(references))
    for layer, reference in zip(held, references):
        entries = attention[layer]
        weights = [w for _, w in entries]
        assert weights == sorted(weights, reverse=True)
        assert all(0 <= p < total for p, _ in entries) and len({p for p, _ in entries}) == len(entries)
        assert len(entries) >= min(8, total)
        for position, weight in entries:  # each recorded weight is eager's at that buffer position
            assert abs(reference[position].item() - weight) < 1e-4, (layer, position)
        top = reference.topk(min(8, total)).values.tolist()  # the 8 largest, whatever their positions
        assert max(abs(a - b) for a, b in zip(top, weights[:8])) < 1e-4
        recorded = {p for p, _ in entries}
        missing = [p for p, w in enumerate(reference.tolist()) if w >= 0.01 + 1e-4 and p not in recorded]
        assert not missing, (layer, missing)  # every position of weight >= 0.01 is there


def watched_steps(model, tokenizer, ids: torch.Tensor, cache, decode: int = 2):
    """A prefill of `ids` and `decode` greedy steps, watched with attention=True: (snapshots, every token)."""
    snapshots = []
    with torch.no_grad(), kvtui.watch(model, tokenizer, attention=True, on_snapshot=snapshots.append):
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        tokens = ids
        for _ in range(decode):
            nxt = out.logits[:, -1:].argmax(-1)
            tokens = torch.cat([tokens, nxt], dim=1)
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
    return snapshots, tokens


@pytest.mark.parametrize("arch", MATRIX_ARCHES)
def test_every_family_matches_eager(arch, tiny_dir, tiny_model):
    """Each family with attention layers, loaded with its default implementation (sdpa where it has one):
    every layer's recorded row equals eager's, the prefill's newest query and each decode step's. A family
    whose modeling code does not go through the attention interface records none (README says so)."""
    model, tokenizer = tiny_model(arch)
    watchable(model)
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    snapshots, tokens = watched_steps(model, tokenizer, ids, DynamicCache(config=model.config))
    assert len(snapshots) == 3
    if not through_interface(model):
        assert all(snapshot.attention is None for snapshot in snapshots)
        return
    for snapshot in snapshots:
        n = len(snapshot.buffer)
        assert len(snapshot.attention) == model.config.get_text_config().num_hidden_layers
        check_contract(snapshot.attention, eager_rows(tiny_dir(arch), tokens[:, :n]), n)
    assert not capture_module.patched()  # detached: every attention function is the original again


def test_hybrid_layers_without_attention_are_none(tiny_model):
    model, tokenizer = tiny_model("lfm2")
    watchable(model)
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    snapshots, _ = watched_steps(model, tokenizer, ids, DynamicCache(config=model.config), decode=1)
    types = model.config.layer_types
    for snapshot in snapshots:
        assert [entry is None for entry in snapshot.attention] == [t != "full_attention" for t in types]


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_static_and_sliding_caches_map_slots_to_positions(implementation, tiny_dir):
    """A static cache's slots beyond what it holds are never positions; a sliding layer (gemma3: window 8,
    a full layer every 4th) holds only its newest tokens: its weights sit at their buffer positions."""
    for arch, make in (
        ("llama", lambda m: StaticCache(config=m.config, max_cache_len=64)),
        ("gemma3", lambda m: DynamicCache(config=m.config)),
        ("gemma3", lambda m: StaticCache(config=m.config, max_cache_len=64)),
    ):
        directory = tiny_dir(arch)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation=implementation)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(directory)
        ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
        snapshots, tokens = watched_steps(model, tokenizer, ids, make(model))
        for snapshot in snapshots:
            n = len(snapshot.buffer)
            check_contract(snapshot.attention, eager_rows(directory, tokens[:, :n]), n)
        if arch == "gemma3":
            sliding = [i for i, t in enumerate(model.config.layer_types) if t == "sliding_attention"]
            window = model.config.sliding_window
            last = snapshots[-1]
            assert all(p >= len(last.buffer) - window for i in sliding for p, _ in last.attention[i])


def test_sdpa_watched_equals_eager_watched_and_output_is_unchanged(tiny_dir):
    """The same model under sdpa and under eager, both watched: the same rows; the sdpa model's logits with the
    capture on are bit-identical to its logits unwatched, and every registry entry is restored exactly."""
    from transformers import AutoTokenizer
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    directory = tiny_dir("qwen3")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    runs = {}
    for implementation in ("sdpa", "eager"):
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation=implementation)
        runs[implementation] = watched_steps(model, tokenizer, ids, DynamicCache(config=model.config))[0]
    for sdpa, eager in zip(runs["sdpa"], runs["eager"]):
        for a, b in zip(sdpa.attention, eager.attention):
            assert [p for p, _ in a[:8]] == [p for p, _ in b[:8]]
            assert max(abs(x - y) for (_, x), (_, y) in zip(a, b)) < 1e-5

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)  # sdpa
    modeling = sys.modules[type(model.model.layers[0].self_attn).__module__]
    before = (dict(AttentionInterface._global_mapping), dict(ALL_ATTENTION_FUNCTIONS._local_mapping))
    eager_before = modeling.eager_attention_forward

    def run(watched: bool):
        cache = DynamicCache(config=model.config)
        logits = []
        with torch.no_grad():
            watcher = kvtui.watch(model, tokenizer, attention=True) if watched else None
            try:
                out = model(input_ids=ids, past_key_values=cache, use_cache=True)
                logits.append(out.logits)
                for _ in range(3):
                    out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
                    logits.append(out.logits)
                if watched:
                    assert capture_module.patched() and watcher.last.attention is not None
            finally:
                if watcher is not None:
                    watcher.detach()
        return logits, [layer.keys for layer in cache.layers]

    plain, plain_keys = run(False)
    watched, watched_keys = run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, watched))
    assert all(torch.equal(a, b) for a, b in zip(plain_keys, watched_keys))
    after = (dict(AttentionInterface._global_mapping), dict(ALL_ATTENTION_FUNCTIONS._local_mapping))
    assert all(after[i][k] is v for i in (0, 1) for k, v in before[i].items()) and after[0].keys() == before[0].keys()
    assert modeling.eager_attention_forward is eager_before and not capture_module.patched()
    assert not any(vars(model).get(name) for name in vars(model) if "kvtui" in name)


def test_batch_rows_are_row_zero(tiny_dir, tiny_model):
    """Batch > 1 (left padding): the recorded rows are batch row 0's, its pads masked (weight 0)."""
    model, tokenizer = tiny_model("llama")
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(["Sliding window", TEXT], return_tensors="pt", padding=True)
    snapshots = []
    with torch.no_grad(), kvtui.watch(model, tokenizer, attention=True, on_snapshot=snapshots.append):
        model(**batch, past_key_values=DynamicCache(config=model.config), use_cache=True)
    snapshot = snapshots[0]
    assert snapshot.batch == 2 and snapshot.row == 0
    references = eager_rows(tiny_dir("llama"), batch["input_ids"], batch["attention_mask"])
    check_contract(snapshot.attention, references, len(snapshot.buffer))
    pads = {i for i, m in enumerate(batch["attention_mask"][0].tolist()) if m == 0}
    assert pads and all(w == 0.0 for entry in snapshot.attention for p, w in entry if p in pads)


def test_embedded_smollm2_matches_eager():
    from transformers import AutoTokenizer

    from kvtui.engine.models.embedded import embedded_model_dir

    directory = embedded_model_dir()
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert model.config._attn_implementation == "sdpa"
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    snapshots, tokens = watched_steps(model, tokenizer, ids, DynamicCache(config=model.config), decode=2)
    for snapshot in snapshots:
        n = len(snapshot.buffer)
        assert len(snapshot.attention) == 30
        check_contract(snapshot.attention, eager_rows(directory, tokens[:, :n]), n)
    detail = snapshots[-1].attention_detail
    assert detail.layer == 29 and len(detail.heads) == 9 and len(detail.groups) == 3  # GQA: 9 query heads, 3 KV
    sink = [row[detail.regions.index("sink")] for row in detail.shares]
    # a trained model sinks much of its attention into the first token: 10x what a uniform row would give it
    assert sum(sink) / len(sink) > 10 / len(snapshots[-1].buffer)


def test_trace_round_trip_and_old_traces(tiny_model, tmp_path):
    model, tokenizer = tiny_model("llama")
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    snapshots, _ = watched_steps(model, tokenizer, ids, DynamicCache(config=model.config), decode=1)
    from kvtui.engine.records.codec import _step

    snapshot = snapshots[-1]
    record = step_record(snapshot)
    back = _step(record, snapshot.buffer)
    assert back.attention == snapshot.attention and back.attention_detail == snapshot.attention_detail
    old = {**record, "attention": {"layer": 1, "weights": [0.5, 0.3, 0.15, 0.05] + [0.0] * 10}}
    read = _step(old, snapshot.buffer)
    assert read.attention == (None, ((0, 0.5), (1, 0.3), (2, 0.15), (3, 0.05), (4, 0.0), (5, 0.0), (6, 0.0), (7, 0.0)))


def test_flex_attention_is_captured(tiny_dir):
    """flex attention (its mask a BlockMask): the recorded rows match eager's too."""
    from transformers import AutoTokenizer

    directory = tiny_dir("llama")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="flex_attention")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    snapshots, tokens = watched_steps(model, tokenizer, ids, DynamicCache(config=model.config), decode=1)
    for snapshot in snapshots:
        n = len(snapshot.buffer)
        check_contract(snapshot.attention, eager_rows(directory, tokens[:, :n]), n)


def test_staged_shares_equal_the_whole_buffers():
    """A watched step stages its attention before its new tokens are known (their ids and mask come back in the
    same transfer) and adds their columns after: every region's share, and the tops, equal a reduction over the
    finished buffer at once. Cases: a decode step that goes on with a turn, a prefill that starts one, a pad id
    that doubles as the end id repeated (the column before the new token joins the pads), the sink's first step."""
    from kvtui.engine.records.snapshot import BufferToken, TokenBuffer

    module = torch.nn.Module()
    module.attn = torch.nn.Module()
    module.attn.layer_idx = 0
    module.other = torch.nn.Module()
    module.other.layer_idx = 1
    capture = capture_module.AttentionCapture(module)
    try:
        generator = torch.Generator().manual_seed(0)
        eos = 2

        def token(position: int, id_: int, turn: int, origin: str = "fed") -> BufferToken:
            return BufferToken(position=position, id=id_, piece=str(id_), special=id_ == eos, origin=origin, turn=turn)

        def scores(total: int) -> dict:
            # two layers: heads 4 of 2 KV heads; the second holds the last 6 positions only (a sliding layer)
            return {
                0: capture_module.Scores(torch.randn(4, total, generator=generator), None, 0.5, None, None, 2),
                1: capture_module.Scores(torch.randn(4, min(6, total), generator=generator), None, 0.5, None, None, 2),
            }

        def step(items: list, new: list, turn: int):
            rows = scores(len(items) + len(new))
            capture._rows = dict(rows)
            reads = introspect.HostReads()
            staged = capture.stage(reads, TokenBuffer(items), len(items) + len(new), eos, False)
            items.extend(new)
            got = capture.finish(staged, TokenBuffer(items), turn, eos, False)
            fresh = capture_module.AttentionCapture.__new__(capture_module.AttentionCapture)
            fresh.__dict__.update(capture.__dict__)
            fresh._regions = capture_module.RegionIndex()  # a reduction over the whole finished buffer
            fresh._rows = dict(rows)
            want = fresh.take(list(items), turn, eos, False)
            assert got.detail.regions == want.detail.regions
            for a, b in zip(got.detail.shares, want.detail.shares):
                assert a == pytest.approx(b, abs=1e-6)
                assert sum(a) == pytest.approx(1, abs=1e-5)  # a partition of the positions: every weight once
            assert got.layers == want.layers and got.pads == want.pads
            return got

        def again(*args, **kwargs):  # the staged sums served every step: no reduction over the buffer again
            raise AssertionError("finish reduced the buffer again")

        capture._again = again
        items: list = []
        step(items, [token(0, 1, 1), token(1, 5, 1), token(2, 6, 1)], 1)  # the first prefill: the sink is new
        for position in range(3, 20):  # decode steps going on with turn 1, past the last-16 window
            step(items, [token(position, 7 + position, 1)], 1)
        step(items, [token(20, 3, 2), token(21, 4, 2)], 2)  # a prefill: turn 2 starts
        step(items, [token(22, eos, 2)], 2)
        got = step(items, [token(23, eos, 2)], 2)  # the end id again: a run of the pad id, both are pads
        assert got.pads == (22, 23)
        step(items, [token(24, 0, 2, origin="pad")], 2)  # a pad the mask says
    finally:
        capture.detach()


@pytest.mark.parametrize(
    "values",
    [
        [],
        [0.5, 0.3],
        [0.3, 0.2, 0.1, 0.1, 0.05, 0.05, 0.04, 0.03, 0.02, 0.01, 0.009, 0.5],  # the first below the floor ends it
        [0.2] * 8 + [0.001] * 4,  # the KEEP largest, whatever they weigh
        [float("nan")] * 10 + [0.001],  # NaN is not below the floor (as `<` says)
    ],
)
def test_the_kept_top_is_the_rank_loop(values):
    """`_top` (C-level passes) keeps what the loop over the ranks kept: the KEEP largest, then to the first below
    FLOOR; indices as ints."""
    indices = [float(i * 3) for i in range(len(values))]
    kept = []
    for rank, (weight, index) in enumerate(zip(values, indices)):
        if rank >= capture_module.KEEP and weight < capture_module.FLOOR:
            break
        kept.append((int(index), weight))
    assert repr(capture_module._top(values, indices)) == repr(tuple(kept))
    assert repr(capture_module._top(values, indices[:3])) == repr(tuple(kept[:3]))  # the shorter one bounds it

"""Whole runs replay as they were: a torchrun run's ranks each record their shard of every layer (2 of a 4-KV-
head model's heads on 2 ranks); the viewer merges the shards live (`tensor-parallel shards, merged`), and the
trace keeps that merge (`tensor_parallel` on the header and on each rank's steps), so `kvtui replay` and the
notebook show the model's 4 KV heads, not a rank's 2."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtui.engine.records.codec import from_record, sharded_step_record, step_record
from kvtui.engine.records.replay import Replay
from kvtui.engine.records.snapshot import LayerInfo, StepSnapshot, TokenBuffer
from kvtui.engine.records.trace import read_trace
from kvtui.engine.watch.tree import ProcessRun, sharded_ranks, shards, tensor_parallel
from kvtui.engine.watch.tree_source import TreeSource
from kvtui.widgets.step.layers_pane import render_totals
from program_headers import model_dir

ROOT = Path(__file__).resolve().parents[3]
TP_LOOP = ROOT / "samples" / "programs" / "tp_loop.py"
# the merge of the ranks' shards is kvtui's; the tensor-parallel forward they come from is watched on both versions
# by test_tree's torchrun shard test
MERGE_ONLY = pytest.mark.version_free("merging the ranks' shards (kvtui's): the TP forward is checked on both")


@pytest.fixture(scope="module")
def four_kv_heads(tmp_path_factory) -> Path:
    """The tiny Llama (its tokenizer, 4 query heads of 16) with 4 KV heads instead of 2: random weights."""
    from transformers import AutoConfig, LlamaForCausalLM

    source = model_dir("tiny:llama")
    out = tmp_path_factory.mktemp("llama-4kv")
    config = AutoConfig.from_pretrained(source)
    config.num_key_value_heads = 4
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    return out


def one_step(layers: int = 2, heads: int = 2, **changes) -> StepSnapshot:
    layer = [
        LayerInfo(i, "full", (1, heads, 5, 16), (1, heads, 5, 16), "float32", "cpu", 640, 5, None, None, 5, 0)
        for i in range(layers)
    ]
    values = dict(
        step=1,
        phase="prefill",
        turn=0,
        input_ids=(),
        positions=(),
        cursor=5,
        cache_seq_length=5,
        capacity=None,
        layers=tuple(layer),
        topk=(),
        topk_processed=(),
        watched=(),
        chosen=None,
        chosen_forced=False,
        diagnostics=(),
        forward_ms=1.0,
        snapshot_ms=0.5,
        buffer=TokenBuffer([]),
    )
    return StepSnapshot(**{**values, **changes})


def test_a_ranks_step_marked_sharded_reads_back_with_the_heads_in_all():
    whole = one_step()
    record = step_record(whole)
    assert "tensor_parallel" not in record and from_record(StepSnapshot, record, buffer=whole.buffer) == whole
    assert whole.kv_heads == 2 and "KV heads 2" in render_totals(whole).plain
    shard = from_record(StepSnapshot, sharded_step_record(record, 2), buffer=whole.buffer)
    assert shard.tensor_parallel == 2 and shard.layers == whole.layers and shard.kv_heads == 4
    assert step_record(shard) == sharded_step_record(record, 2)  # the value writes what it read
    assert "KV heads 4 in all: 2 ranks × 2 each" in render_totals(shard).plain


@MERGE_ONLY
def test_a_torchrun_trace_replays_the_models_kv_heads_in_all(tmp_path, four_kv_heads):
    trace = tmp_path / "tp.jsonl"
    launcher = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2"]
    command = [sys.executable, "-m", "kvtui.cli", "watch", "--headless", "--trace", str(trace), "--"]
    watched = subprocess.run(
        [*command, *launcher, str(TP_LOOP), str(four_kv_heads)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )
    assert watched.returncode == 0, watched.stderr[-3000:]
    assert "KV heads held per layer: 2" in watched.stderr  # each rank holds half
    assert " · 2 ranks × 2 heads (layer 0, forward 8)" in watched.stderr  # the live view's merge

    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert records[0]["tensor_parallel"] == 2
    steps = [r for r in records if r["type"] == "step"]
    assert len(steps) == 16 and all(s["tensor_parallel"] == 2 and s["layers"][0]["k_shape"][1] == 2 for s in steps)

    replay = Replay(read_trace(trace))
    assert "tensor parallel over 2 ranks" in replay.describe()
    for snapshot in (replay.snapshots[0], replay.snapshots[-1]):
        assert snapshot.tensor_parallel == 2 and snapshot.kv_heads == 4
        assert all(layer.k_shape[1] == 2 for layer in snapshot.layers)  # what the rank holds, as recorded
    shown = render_totals(replay.snapshots[-1]).plain
    assert "KV heads 4 in all: 2 ranks × 2 each" in shown and "KV heads 2 " not in shown

    from kvtui.notebook import to_html, view

    page = html.unescape(re.sub(r"<[^>]+>", "", to_html(view(replay))))
    assert "KV heads 4 in all: 2 ranks × 2 each" in page  # the notebook's replay: the same pane text


def _rank(rank: int, heads_per_rank: int, model_kv_heads: int | None) -> ProcessRun:
    run = ProcessRun(pid=100 + rank, argv=["prog.py"], rank=rank, world_size=2)
    if model_kv_heads is not None:
        run.add({"type": "model", "index": 0, "name": "m", "class": "LlamaForCausalLM", "kv_heads": model_kv_heads})
    run.add({"type": "step", "step": 1, "layers": [{"k_shape": [1, heads_per_rank, 7, 16]}]})
    return run


def test_ranks_that_each_hold_the_whole_model_are_not_merged_as_shards():
    """Two data-parallel ranks of a 2-KV-head model hold 2 heads each, as two tensor-parallel ranks of a
    4-head model do: the model's own KV heads (its record) tell them apart; without the record, the shapes."""
    assert sharded_ranks([_rank(0, 2, 4), _rank(1, 2, 4)]) is not None  # tensor parallel: 2 × 2 = 4
    assert sharded_ranks([_rank(0, 2, 2), _rank(1, 2, 2)]) is None  # data parallel: each holds all 2
    assert shards([_rank(0, 2, 2), _rank(1, 2, 2)]) is None
    assert sharded_ranks([_rank(0, 2, None), _rank(1, 2, None)]) is not None  # an older trace: as before


@MERGE_ONLY
def test_a_torchrun_run_watched_live_and_its_replay_show_the_same_kv_heads_at_every_step(tmp_path, four_kv_heads):
    """The live source of `kvtui watch -- torchrun ...` (what the TUI reads) marks each rank's step as a shard,
    as the trace's merge does, from one function (tree.tensor_parallel): the same KV heads in all, 4, at every
    step of every rank, live and replayed; each rank's layers still hold its own 2."""
    trace = tmp_path / "live.jsonl"
    torchrun = str(Path(sys.executable).parent / "torchrun")
    source = TreeSource(
        torchrun, ["--standalone", "--nproc-per-node", "2", str(TP_LOOP), str(four_kv_heads)], trace=trace
    )
    live: dict[str, list[tuple]] = {}
    try:
        for record in source.records():
            if record["type"] == "step":
                snapshot = from_record(StepSnapshot, record, buffer=TokenBuffer([]))
                live.setdefault(snapshot.model, []).append((snapshot.kv_heads, snapshot.layers[0].k_shape))
    finally:
        source.stop()
    assert len(live) == 2 and all(len(steps) == 8 for steps in live.values()), live
    assert {heads for steps in live.values() for heads, _ in steps} == {4}  # the model's, not a rank's 2
    assert {shape[1] for steps in live.values() for _, shape in steps} == {2}

    replayed: dict[str, list[tuple]] = {}
    for snapshot in Replay(read_trace(trace)).snapshots:
        replayed.setdefault(snapshot.model, []).append((snapshot.kv_heads, snapshot.layers[0].k_shape))
    assert replayed == live  # the same process, the same step: the same heads, in all and per rank


def test_one_judgement_tells_a_shard_from_a_whole_model():
    step = {"type": "step", "layers": [{"k_shape": [1, 2, 7, 16]}]}
    assert tensor_parallel(2, 4, step) == 2  # 2 ranks x 2 heads = the model's 4
    assert tensor_parallel(2, 2, step) is None  # each rank holds all 2: data parallel
    assert tensor_parallel(None, 4, step) is None and tensor_parallel(1, 2, step) is None  # one process
    assert tensor_parallel(2, None, step) is None  # the model's heads unknown: shown as recorded

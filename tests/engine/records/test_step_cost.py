"""The cheap per-step paths give what the plain computations give: top-k from topk + log_softmax, the greedy
choice read from it, the faster frozen dataclasses, the cache fingerprint's identity checks, the writer
thread's order and durability."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import os
import pickle
import threading
from itertools import repeat

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, StaticCache

from kvtui.engine.chat.sampling import Sampler, SamplerSettings, chosen_from_top, top_token_rows, top_tokens
from kvtui.engine.reading import introspect
from kvtui.engine.records.codec import to_record
from kvtui.engine.records.snapshot import BufferToken, LayerInfo, StepSnapshot, TokenBuffer, TopToken, from_columns
from kvtui.engine.records.trace import LineWriter, TraceWriter, record_line
from kvtui.engine.watch.watch_step import _fed_tokens


def _reference(scores: torch.Tensor, k: int) -> list[tuple[int, float, float]]:
    """(id, logit, prob) of the k best, the slow way: a float64 softmax over the whole vocab."""
    probs = torch.softmax(scores.double(), dim=-1)
    order = torch.argsort(scores.double(), descending=True, stable=True)[:k]
    return [(int(i), float(scores[i]), float(probs[i])) for i in order]


@pytest.mark.parametrize("vocab", [7, 512, 49152])
def test_top_tokens_match_a_full_softmax(vocab):
    generator = torch.Generator().manual_seed(vocab)
    scores = torch.randn(3, vocab, generator=generator) * 4  # [rows, vocab]
    scores[1, : vocab // 2] = -torch.inf  # a top-k / top-p mask
    rows = top_token_rows(scores, 10, lambda i: f"<{i}>")
    assert len(rows) == 3
    for row, tops in zip(scores, rows):
        want = [w for w in _reference(row, 10) if w[2] > 0]
        assert [t.id for t in tops] == [w[0] for w in want]
        assert [t.rank for t in tops] == list(range(1, len(want) + 1))
        for token, (_, logit, prob) in zip(tops, want):
            assert token.logit == pytest.approx(logit, abs=0)  # the float32 value itself
            assert token.prob == pytest.approx(prob, rel=1e-5)
            assert token.text == f"<{token.id}>"
    assert top_tokens(scores[0], 10, lambda i: f"<{i}>") == rows[0]


def test_greedy_reads_the_top_unless_the_first_two_tie():
    sampler = Sampler(SamplerSettings())  # greedy
    scores = torch.tensor([0.5, 3.0, 1.0, 3.0, -1.0])  # ids 1 and 3 tie: argmax takes the first, 1
    top = top_tokens(scores, 3, str)
    assert top[0].logit == top[1].logit
    assert sampler.choose(scores, top) == int(torch.argmax(scores)) == 1
    clear = torch.tensor([0.5, 2.0, 1.0, 3.0, -1.0])
    assert sampler.choose(clear, top_tokens(clear, 3, str)) == 3


def test_the_chosen_token_rank_counts_the_tokens_above_it():
    scores = torch.tensor([2.0, 5.0, 5.0, 1.0])
    top = top_tokens(scores, 4, str)
    chosen = chosen_from_top(top, 2)  # tied for first: rank 1, as (probs > prob).sum() + 1 says
    probs = torch.softmax(scores, dim=-1)
    assert chosen.rank == int((probs > probs[2]).sum()) + 1 == 1
    assert chosen_from_top(top, 3).rank == 4
    assert chosen_from_top(top[:2], 3) is None  # not among them: the caller reads the whole distribution


def test_frozen_dataclasses_build_what_dataclasses_builds():
    info = LayerInfo(2, "sliding", (1, 2, 3, 4), (1, 2, 3, 4), "float32", "cpu", 96, 3, 3, 4, 7, 4, quant_bits=4)
    assert (info.index, info.window, info.held_from, info.quant_bits, info.states, info.offloaded) == (
        2,
        4,
        4,
        4,
        (),
        False,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.index = 3
    assert pickle.loads(pickle.dumps(info)) == info == copy.deepcopy(info)
    assert hash(info) == hash(dataclasses.replace(info))
    assert dataclasses.replace(info, index=5).index == 5
    with pytest.raises(TypeError):
        LayerInfo(1, "full")  # required fields stay required
    snapshot = StepSnapshot(
        step=1,
        phase="decode",
        turn=1,
        input_ids=(5,),
        positions=(0,),
        cursor=1,
        cache_seq_length=1,
        capacity=None,
        layers=(info,),
        topk=(),
        topk_processed=(),
        watched=(),
        chosen=TopToken(5, "a", 1.0, 0.5, 1),
        chosen_forced=False,
        diagnostics=(),
        forward_ms=1.0,
        snapshot_ms=0.1,
        buffer=TokenBuffer([BufferToken(0, 5, "a", False, "fed", 1)]),
    )
    assert snapshot.source == "session" and snapshot.line == [] and snapshot.rows is None
    assert dataclasses.replace(snapshot, step=2).line is not snapshot.line  # a record box of its own


def test_objects_built_from_columns_are_what_their_init_builds():
    made = from_columns(BufferToken, 2, ([3, 4], [7, 8], ["a", "b"], [True, False], repeat("fed"), repeat(2)))
    assert made == [BufferToken(3, 7, "a", True, "fed", 2), BufferToken(4, 8, "b", False, "fed", 2)]
    assert pickle.loads(pickle.dumps(made[0])) == made[0] and hash(made[0]) == hash(
        BufferToken(3, 7, "a", True, "fed", 2)
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        made[0].id = 1


@pytest.mark.parametrize(
    "positions, mask, added",
    [
        ([5, 6, 7], [1, 1, 1], ()),  # the C-level path
        ([5, 6, 7, 8], [1, 1, 1], ()),  # more positions than tokens: the first n
        ([5, 6, 7], [0, 1, 1], ()),  # a pad: token by token
        ([5, 6, 7], [1, 1, 1], {0}),  # a tokenizer-added id
    ],
)
def test_fed_tokens_are_the_same_on_either_path(positions, mask, added):
    ids, pieces = [1, 9, 4], ["<s>", "x", "y"]
    expected = [
        BufferToken(
            positions[i],
            ids[i],
            pieces[i],
            ids[i] in {1},
            "pad" if not mask[i] else "tokenizer-added" if i in added else "fed",
            3,
        )
        for i in range(3)
    ]
    assert _fed_tokens(3, positions, ids, pieces, frozenset({1}), 3, mask, added) == expected


def test_fed_tokens_with_too_few_positions_fail_as_indexing_them_does():
    with pytest.raises(IndexError):
        _fed_tokens(3, [5, 6], [1, 9, 4], ["a", "b", "c"], frozenset(), 0, [1, 1, 1], ())


def test_a_step_is_serialised_once_for_every_sink():
    snapshot = StepSnapshot(
        step=1,
        phase="decode",
        turn=1,
        input_ids=(5,),
        positions=(0,),
        cursor=1,
        cache_seq_length=1,
        capacity=None,
        layers=(),
        topk=(),
        topk_processed=(),
        watched=(),
        chosen=None,
        chosen_forced=False,
        diagnostics=(),
        forward_ms=1.0,
        snapshot_ms=0.1,
        buffer=TokenBuffer([BufferToken(0, 5, "a", False, "fed", 1)]),
    )
    line = record_line(snapshot)
    assert json.loads(line) == json.loads(json.dumps(to_record(snapshot))) and line.endswith(b"\n")
    assert record_line(snapshot) is line  # the second sink reuses the text


def test_the_line_writer_keeps_order_and_writes_everything_by_close(tmp_path):
    path = tmp_path / "t.jsonl"
    writer = TraceWriter(path, {"type": "header", "n": 0})
    threads = []
    for part in range(4):  # several producers: each one's records stay in its order

        def produce(part=part):
            for i in range(250):
                writer.write({"type": "n", "part": part, "i": i})

        threads.append(threading.Thread(target=produce))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    writer.flush()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records[0] == {"type": "header", "n": 0} and len(records) == 1001  # drained: all of it on disk
    for part in range(4):
        assert [r["i"] for r in records[1:] if r["part"] == part] == list(range(250))
    writer.write({"type": "last"})
    writer.close()
    assert json.loads(path.read_text().splitlines()[-1]) == {"type": "last"}
    writer.write({"type": "after close"})  # ignored, as before
    assert "after close" not in path.read_text()


def test_a_write_error_is_raised_at_the_next_write():
    class Full(io.BytesIO):
        def write(self, text):
            raise OSError(28, "No space left on device")

    writer = LineWriter(Full(), "test-writer")
    writer.put({"type": "a"})
    writer.drain()
    with pytest.raises(OSError, match="No space"):
        writer.put({"type": "b"})
    writer.close()
    quiet = LineWriter(Full(), "test-writer", raise_errors=False)  # a viewer's pipe: a gone viewer is not an error
    quiet.put({"type": "a"})
    quiet.drain()
    quiet.put({"type": "b"})
    quiet.close()


@pytest.mark.parametrize("mode", [torch.inference_mode, torch.no_grad])
def test_the_cache_fingerprint_sees_what_the_program_did(mode):
    config = LlamaConfig(
        num_hidden_layers=3, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=64
    )
    with mode():
        cache = DynamicCache(config=config)
        for layer in range(3):
            cache.update(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), layer)

        def check(edit) -> str | None:
            before = introspect.fingerprint(cache)
            edit()
            found = introspect.changed(before, cache)
            assert before.layers == [] and before.views == []  # spent: holds nothing of the cache any more
            return found

        assert check(lambda: None) is None
        layer = cache.layers[1]
        assert check(lambda: setattr(layer, "keys", layer.keys)) is None  # the same tensor put back: nothing
        assert (
            check(lambda: cache.layers[1].values[:, :, -1].mul_(2)) == "K/V values edited in place in 1 of 3 layers (1)"
        )
        assert check(lambda: cache.layers[2].keys[:, :, 0].zero_()) == "K/V values edited in place in 1 of 3 layers (2)"
        assert check(lambda: setattr(layer, "keys", layer.keys.clone())) == "K/V tensors replaced in 1 of 3 layers (1)"
        assert check(lambda: cache.crop(-2)) == "shortened from 5 to 3 tokens (cropped)"
        assert check(lambda: cache.reset()) is not None


@pytest.mark.parametrize("filled", [1, 2, 7])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "mixed"])
def test_the_end_slot_views_are_slots_0_and_last(filled, layout):
    """The fingerprint's end-slot views (as_strided when every K and V shares one shape and stride, indexed
    otherwise) hold slots 0 and filled-1 of each tensor, for any slot count and memory layout, and an in-place
    edit of either slot is named."""
    config = LlamaConfig(
        num_hidden_layers=3, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=64
    )

    def tensor(layer: int) -> torch.Tensor:
        made = torch.randn(1, 2, filled, 8)
        if layout == "transposed" or (layout == "mixed" and layer == 1):  # same values, another stride
            made = made.transpose(2, 3).contiguous().transpose(2, 3)
        return made

    with torch.inference_mode():
        cache = DynamicCache(config=config)
        for layer in range(3):
            cache.update(tensor(layer), tensor(layer), layer)
        fingerprint = introspect.fingerprint(cache)
        tensors = [layer.keys for layer in cache.layers] + [layer.values for layer in cache.layers]
        slots = [0] if filled == 1 else [0, filled - 1]
        assert len(fingerprint.views) == 6
        assert [index for index, _ in fingerprint.views] == [0, 1, 2, 0, 1, 2]  # each view's layer
        for (_, view), held in zip(fingerprint.views, tensors):
            assert torch.equal(view, held[:, :, slots]) and view.data_ptr() >= held.data_ptr()  # a view, no copy
        assert introspect.changed(fingerprint, cache) is None
        for slot, layer in ((0, 2), (filled - 1, 0)):
            before = introspect.fingerprint(cache)
            cache.layers[layer].values[:, :, slot] += 1.0
            assert introspect.changed(before, cache) == f"K/V values edited in place in 1 of 3 layers ({layer})"


def _written(snapshot) -> dict:
    return json.loads(record_line(snapshot))


def _plain_record(snapshot) -> dict:
    return json.loads(json.dumps(to_record(snapshot), ensure_ascii=False, allow_nan=False))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_written_step_line_is_the_step_record(tiny_model, arch):
    """The writer serialises a step's dataclasses directly (orjson); the line must read back as exactly the
    record `to_record(snapshot)` builds: kvtui's own session (sampler on, sliding layers on gemma3) and a watched
    batch (rows, lineage)."""
    from kvtui.engine.chat.session import ChatSession, SessionConfig
    from kvtui.engine.chat.settings import SamplerSettings
    from kvtui.engine.watch.probe import watch

    model, tokenizer = tiny_model(arch)
    session = ChatSession(
        model, tokenizer, SessionConfig(max_new_tokens=4, sampler=SamplerSettings(temperature=0.7, top_k=20, seed=1))
    )
    snapshots = [session.send("héllo <there>")] + [session.step() for _ in range(3)]
    with watch(model, tokenizer) as watcher:
        seen = []
        watcher.on_snapshot = seen.append
        ids = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]])
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=(ids != 0).long(), past_key_values=cache)
            model(
                input_ids=torch.tensor([[11], [12]]),
                attention_mask=torch.ones(2, 5, dtype=torch.long),
                past_key_values=copy.deepcopy(cache),
            )
    snapshots += seen
    assert seen and seen[-1].rows and seen[-1].cache_parent is not None
    for snapshot in snapshots:
        assert _written(snapshot) == _plain_record(snapshot)


def _step_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().splitlines() if line.startswith(b'{"type":"step"')]


def test_a_finished_step_is_on_disk_before_the_next_line_runs(tiny_model, tmp_path):
    """A trace file is written and flushed on the thread that ran the forward: when a watched forward or a
    session step returns, its line is already in the file (so a SIGKILL at any later point keeps it),
    with no flush or close asked for. A writer thread made this a race."""
    from kvtui.engine.chat.session import ChatSession, SessionConfig
    from kvtui.engine.records.recorder import Recorder
    from kvtui.engine.watch.probe import watch

    model, tokenizer = tiny_model("llama")
    path = tmp_path / "watched.jsonl"
    with watch(model, tokenizer, trace=path):
        cache = DynamicCache(config=model.config)
        ids = torch.tensor([[5, 6, 7]])
        with torch.inference_mode():
            for step in range(1, 6):
                ids = model(input_ids=ids, past_key_values=cache).logits[:, -1:].argmax(-1)
                assert [r["step"] for r in _step_lines(path)] == list(range(1, step + 1))
    session = ChatSession(model, tokenizer, SessionConfig(max_new_tokens=10**6))
    path = tmp_path / "session.jsonl"
    recorder = Recorder(session, path)
    session.send("hello")
    for step in range(2, 6):
        session.step()
        assert [r["step"] for r in _step_lines(path)] == list(range(1, step + 1))
    recorder.close()


def test_a_forked_child_never_writes_into_its_parents_trace(tmp_path):
    """A child forked without exec inherits the writer: its lines would land in the middle of the parent's."""
    if not hasattr(os, "fork"):
        pytest.skip("needs os.fork")
    path = tmp_path / "t.jsonl"
    writer = TraceWriter(path, {"type": "header"})
    writer.write({"type": "parent", "i": 1})
    pid = os.fork()
    if pid == 0:  # the child: writes, then leaves at once (no atexit, no test teardown)
        writer.write({"type": "child"})
        os._exit(0)
    os.waitpid(pid, 0)
    writer.write({"type": "parent", "i": 2})
    writer.close()
    assert [json.loads(line)["type"] for line in path.read_text().splitlines()] == ["header", "parent", "parent"]


def test_static_layer_counters_are_read_together_not_one_device_wait_per_layer(monkeypatch):
    """5.x keeps a static layer's token counter in a 0-dim tensor on the cache's device: int() on each is one
    wait for the device per layer (~60 a step for 30 layers on a GPU). Reading the layers reads them in one
    transfer, and still each layer's own count. (The counters here are CPU tensors, which are read one by one:
    the test reads them as if they were on a device.)"""
    config = LlamaConfig(
        num_hidden_layers=6, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=64
    )
    cache = StaticCache(config=config, max_cache_len=32)
    with torch.inference_mode():
        for layer in range(6):
            cache.update(torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16), layer, {"cache_position": torch.arange(5)})
        if not isinstance(getattr(cache.layers[3], "cumulative_length", None), torch.Tensor):
            pytest.skip("this transformers keeps no tensor counter in a static layer (4.x: none at all)")
        cache.layers[3].cumulative_length.add_(2)  # one layer ahead: every layer's own count must be read
    assert [info.seen for info in introspect.layer_infos(cache)] == [5, 5, 5, 7, 5, 5]  # on the CPU, one by one
    monkeypatch.setattr(introspect.layers, "_on_host", lambda counter: False)
    reads: list[str] = []
    for name in ("__int__", "item", "tolist"):
        real = getattr(torch.Tensor, name)
        counted = lambda t, *a, _real=real, _name=name: reads.append(_name) or _real(t, *a)  # noqa: E731
        monkeypatch.setattr(torch.Tensor, name, counted)

    infos = introspect.layer_infos(cache)
    assert [info.seen for info in infos] == [5, 5, 5, 7, 5, 5]
    assert [info.filled for info in infos] == [5, 5, 5, 7, 5, 5]
    assert len(reads) <= 2, reads  # the cache's length, then every counter in one read (it was 1 + 6)

    reads.clear()
    fingerprint = introspect.fingerprint(cache)
    assert [entry[3] for entry in fingerprint.layers] == [5, 5, 5, 7, 5, 5]
    assert len(reads) <= 1, reads  # it was 12: a counter and the cache's length per layer
    reads.clear()
    real_equal = torch.equal  # a device read too (its bool): counted from here on
    monkeypatch.setattr(torch, "equal", lambda *a: reads.append("equal") or real_equal(*a))
    assert introspect.changed(fingerprint, cache) is None
    # the counters in one read, the end slots' values in one (they were read by torch.equal, uncounted, before);
    # in a watched step the values come back in the step's own transfer (test_device_reads.py)
    assert len(reads) <= 2, reads

    fingerprint = introspect.fingerprint(cache)
    with torch.inference_mode():
        cache.layers[1].cumulative_length.sub_(1)  # a program moving one counter between forwards
    assert introspect.changed(fingerprint, cache) is not None

"""Replay: a recorded session comes back step by step, without a model, exactly as it was recorded."""

from __future__ import annotations

import pytest

from kvtui import viewers
from kvtui.engine import ChatSession, SessionConfig
from kvtui.engine.records.codec import buffer_record, to_record
from kvtui.engine.records.replay import Replay, transcript
from kvtui.engine.records.trace import TraceError, TraceWriter, header_record, read_trace
from kvtui.widgets.step.cursor_pane import CursorPane
from kvtui.widgets.step.token_buffer import TokenBufferPane
from pilot_helpers import wait_for


@pytest.fixture
def recorded(tiny_model, tmp_path):
    """A live session with a rewind and a forced token, recorded to a trace; returns (path, live snapshots)."""
    model, tok = tiny_model("qwen2")
    path = tmp_path / "session.jsonl"
    live = []
    session = ChatSession(model, tok, SessionConfig(max_new_tokens=5))
    with TraceWriter(path, header_record(session, "tiny-qwen2", "tiny")) as writer:

        def record(snapshot):
            live.append(snapshot)
            writer.write(to_record(snapshot))

        session.on_snapshot.add(record)
        session.send("What is k?")
        session.generate()
        writer.write(buffer_record(session.buffer))
        session.rewind(3)
        session.force(session.last.topk[1].id)
        session.step()
        session.send("And m?")
        session.generate()
        writer.write(buffer_record(session.buffer))
    return path, live


def test_replayed_snapshots_equal_the_live_ones(recorded):
    path, live = recorded
    replay = Replay(read_trace(path))
    assert len(replay) == len(live)
    for got, want in zip(replay.snapshots, live):
        assert got.buffer.ids() == want.buffer.ids()
        assert [(t.position, t.origin, t.piece) for t in got.buffer] == [
            (t.position, t.origin, t.piece) for t in want.buffer
        ]
        assert (got.step, got.phase, got.cursor, got.cache_seq_length) == (
            want.step,
            want.phase,
            want.cursor,
            want.cache_seq_length,
        )
        assert got.layers == want.layers
        assert [t.id for t in got.topk] == [t.id for t in want.topk]
        assert got.chosen.id == want.chosen.id and got.chosen_forced == want.chosen_forced
    assert any(s.phase == "rewind" for s in replay.snapshots)
    roles = [m["role"] for m in transcript(replay.snapshots[-1].buffer)]
    assert roles[:2] == ["user", "assistant"] and "user" in roles[2:]


async def test_replay_app_steps_forward_and_back_without_a_model(recorded, monkeypatch):
    import kvtui.engine.chat.loader as loader

    def no_model(*args, **kwargs):
        raise AssertionError("replay must not load a model")

    monkeypatch.setattr(loader, "load_model", no_model)
    path, live = recorded
    app = viewers.replay(path)
    async with app.run_test(size=(140, 45)) as pilot:
        await wait_for(pilot, lambda: app.view.latest is not None, what="the first recorded step")
        assert app.view.latest.step == live[0].step
        for _ in range(3):
            await pilot.press("space")
            await wait_for(pilot, lambda: app.view.latest.step == live[app.view.driver.position].step, what="a step")
        assert app.view.driver.position == 3
        pane = app.query_one(TokenBufferPane)
        assert len(pane.snapshot.buffer) == len(live[3].buffer)
        assert f"cursor {live[3].cursor}" in " ".join(app.query_one(CursorPane).visual.plain.split())
        await pilot.press("u")
        await wait_for(pilot, lambda: app.view.driver.position == 2, what="a step back")
        await pilot.pause(0.1)
        assert app.view.latest.step == live[2].step
        await pilot.press("r")  # play to the end
        await wait_for(pilot, lambda: app.view.driver.position == len(live) - 1, timeout=20, what="playing to the end")
        await pilot.press("v")  # read-only: says so, keeps going
        await pilot.pause(0.2)
        assert any("read-only" in str(n.message) for n in app._notifications)


def test_replay_of_a_corrupt_trace_names_file_and_line(recorded, tmp_path):
    path, _ = recorded
    lines = path.read_text().splitlines()
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join(lines[:3]) + "\n" + lines[3][: len(lines[3]) // 2] + "\n")
    with pytest.raises(TraceError, match=r"broken.jsonl:4: not valid JSON"):
        viewers.replay(broken)


def test_shipped_traces_replay():
    from pathlib import Path

    traces = sorted((Path(__file__).resolve().parents[2] / "samples").glob("*.trace.jsonl"))
    assert traces, "samples/ ships at least one recorded trace"
    for path in traces:
        replay = Replay(read_trace(path))
        last = replay.snapshots[-1]
        assert last.cursor == last.cache_seq_length == len(last.buffer)
        assert replay.header["model_class"] and len(read_trace(path).buffers) >= 1
        roles = [m["role"] for m in transcript(last.buffer)]
        assert roles.count("user") == len(read_trace(path).buffers)


async def test_replay_of_a_watched_batch_shows_each_row_with_n(tiny_dir, tmp_path):
    """A watched left-padded batch's trace: n shows the step as the next row saw it (its own buffer, pads marked),
    as live; a second n comes back to the first row."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kvtui

    directory = tiny_dir("llama")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    batch = tokenizer(["a longer first prompt here", "Hi"], return_tensors="pt", padding=True)
    path = tmp_path / "batch.jsonl"
    with kvtui.watch(model, tokenizer, trace=path), torch.no_grad():
        model.generate(**batch, max_new_tokens=2, do_sample=False)
    recorded = Replay(read_trace(path)).snapshots[0]  # the prefill, each row's buffer as the trace holds it
    pads = int((batch["attention_mask"][1] == 0).sum())
    assert recorded.batch == 2 and [t.origin for t in recorded.rows[1].buffer].count("pad") == pads > 0
    app = viewers.replay(path)
    async with app.run_test(size=(140, 45)) as pilot:
        await wait_for(pilot, lambda: app.view.latest is not None, what="the first recorded step")
        pane = app.query_one(TokenBufferPane)
        assert pane.snapshot.buffer.ids() == recorded.rows[0].buffer.ids()
        await pilot.press("n")
        await wait_for(pilot, lambda: pane.snapshot.buffer.ids() == recorded.rows[1].buffer.ids(), what="row 2")
        assert [t.origin for t in pane.snapshot.buffer].count("pad") == pads
        await pilot.press("n")
        await wait_for(pilot, lambda: pane.snapshot.buffer.ids() == recorded.rows[0].buffer.ids(), what="row 1")

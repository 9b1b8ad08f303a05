"""The record codec: every record type goes to its dict and back unchanged, older traces' records read with
their defaults, and the trace lines it builds keep the bytes earlier kvtui wrote."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest

from kvtui.engine.records.codec import (
    buffer_record,
    diagnostic_record,
    from_record,
    step_record,
    to_record,
    verify_record,
)
from kvtui.engine.records.codes import CODES, Code
from kvtui.engine.records.replay import Replay
from kvtui.engine.records.snapshot import (
    AttentionDetail,
    BufferToken,
    Diagnostic,
    LayerInfo,
    RowView,
    StepSnapshot,
    TokenBuffer,
    TopToken,
    VerifyResult,
)
from kvtui.engine.records.trace import read_trace, record_line

SAMPLE = Path(__file__).resolve().parents[3] / "samples" / "seed-conversation.trace.jsonl"
# the lines of test_the_trace_lines_keep_their_bytes, as kvtui wrote them before the codec (commit e127b10)
GOLDEN = Path(__file__).with_name("codec_golden.jsonl")

TOKENS = [
    BufferToken(position=0, id=1, piece="<s>", special=True, origin="template", turn=1),
    BufferToken(position=1, id=42, piece=" hi", special=False, origin="user", turn=1),
    BufferToken(position=2, id=7, piece="!", special=False, origin="assistant", turn=2),
]
TOP = (
    TopToken(id=7, text="!", logit=3.5, prob=0.75, rank=1),
    TopToken(id=8, text="?", logit=1.25, prob=0.125, rank=2),
)
LAYERS = (
    LayerInfo(0, "full", (1, 2, 3, 8), (1, 2, 3, 8), "float32", "cpu", 384, 3, None, None, 3, 0),
    LayerInfo(
        1,
        "full+ssm",
        (1, 2, 4, 8),
        (1, 2, 4, 8),
        "float16",
        "cpu",
        999,
        3,
        4,
        2,
        5,
        1,
        states=(("conv", (1, 4, 3)), ("ssm", (1, 2, 8, 8))),
        state_bytes=500,
        quant_bits=4,
        quant_group=64,
        quant_bytes=100,
        residual=2,
        residual_capacity=8,
        offloaded=True,
    ),
)
ALARM = Diagnostic("position-gap", "error", "positions jump from 1 to 5", 3)
VERIFY = VerifyResult(1.5e-05, 0.0001, True, (7, 8, 9), (7, 9, 8), 3, True, 12.5)


def session_step(**changes) -> StepSnapshot:
    values = dict(
        step=3,
        phase="decode",
        turn=2,
        input_ids=(7,),
        positions=(2,),
        cursor=3,
        cache_seq_length=3,
        capacity=None,
        layers=LAYERS,
        topk=TOP,
        topk_processed=TOP[:1],
        watched=(TOP[1],),
        chosen=TOP[0],
        chosen_forced=True,
        diagnostics=(ALARM,),
        forward_ms=1.25,
        snapshot_ms=0.5,
        buffer=TokenBuffer(list(TOKENS)),
        turn_done=True,
    )
    return StepSnapshot(**{**values, **changes})


def watched_step() -> StepSnapshot:
    rows = (
        RowView(row=0, input_ids=(7,), positions=(2,), topk=TOP, buffer=TokenBuffer(list(TOKENS))),
        RowView(row=1, input_ids=(42, 7), positions=(1, 2), topk=TOP[1:], buffer=TokenBuffer(list(TOKENS))),
    )
    return session_step(
        attention=(None, ((1, 0.5), (0, 0.25), (2, 0.25))),
        attention_layer=1,
        attention_detail=AttentionDetail(
            layer=1,
            heads=(((1, 0.75), (0, 0.25)), ((2, 0.5), (1, 0.25), (0, 0.25))),
            groups=(((1, 0.5), (0, 0.25), (2, 0.25)),),
            all_layers=((1, 0.5), (0, 0.25), (2, 0.25)),
            regions=("sink", "this turn", "last 3"),
            shares=(None, (0.25, 1.0, 1.0)),
        ),
        source="watch",
        caller="prog.py:12",
        cache_id="DynamicCache#2",
        cache_length_before=2,
        requested_positions=(2,),
        requested_cache_position=None,
        positions_source="rotary",
        batch=2,
        row=0,
        rows=rows,
        cache_parent="DynamicCache#1",
        cache_copied_at=2,
        cache_unknown=0,
        model="model 1: draft",
        recomputed=4,
        thread="Thread-2 (generate), started at x.py:3",
        compiled=True,
        compile_ms=40.5,
        recompiles=1,
    )


def back(value, **context):
    """to_record, through JSON (what a trace or a pipe does to it), then from_record."""
    return from_record(type(value), json.loads(json.dumps(to_record(value))), **context)


@pytest.mark.parametrize("value", [*TOKENS, *TOP, *LAYERS, ALARM, VERIFY], ids=lambda v: type(v).__name__)
def test_each_value_comes_back(value):
    assert back(value) == value


def test_a_row_comes_back_with_the_buffer_its_reader_rebuilt():
    row = watched_step().rows[1]
    record = to_record(row)
    assert record["fed"] == [to_record(t) for t in TOKENS[-2:]] and record["buffer_length"] == 3
    assert back(row, buffer=row.buffer) == row


@pytest.mark.parametrize("make", [session_step, watched_step, lambda: session_step(uncached=True, layers=())])
def test_a_step_comes_back(make):
    snapshot = make()
    rows = None
    if snapshot.rows:
        rows = tuple(back(r, buffer=r.buffer) for r in snapshot.rows)
    again = back(snapshot, buffer=snapshot.buffer, rows=rows)
    assert again == snapshot
    assert [r.buffer for r in again.rows or ()] == [r.buffer for r in snapshot.rows or ()]


def test_a_step_replays_from_its_line(tmp_path):
    """The replay's way: the buffer rebuilt from the fed tokens of each step line (here a copied cache's)."""
    snapshot = watched_step()
    first = session_step(
        step=2,
        input_ids=(1, 42),
        positions=(0, 1),
        buffer=TokenBuffer(TOKENS[:2]),
        source="watch",
        cache_id="DynamicCache#1",
        diagnostics=(),  # a step line's alarms take its step's number
    )
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"".join(record_line(r) for r in ({"type": "header", "schema": 1}, first, snapshot)))
    replay = Replay(read_trace(path))
    assert replay.snapshots == [first, snapshot] and list(replay.snapshots[-1].buffer) == TOKENS


def test_the_orjson_step_line_is_the_plain_records_bytes():
    for snapshot in (session_step(), watched_step()):
        assert orjson.dumps(step_record(snapshot, objects=True)) == orjson.dumps(step_record(snapshot))
        assert record_line(snapshot) == orjson.dumps(to_record(snapshot)) + b"\n"


def test_the_trace_lines_keep_their_bytes():
    """Every line the codec builds, byte for byte as kvtui wrote it before the codec (compact orjson)."""
    lines = [
        diagnostic_record(ALARM),
        verify_record(VERIFY, 4),
        buffer_record(TOKENS),
        session_step(),
        watched_step(),
        session_step(uncached=True, layers=()),
    ]
    assert b"".join(record_line(line) for line in lines) == GOLDEN.read_bytes()
    assert record_line(diagnostic_record(ALARM, 9)).startswith(b'{"type":"diagnostic","step":9,"code"')
    assert to_record(ALARM) == {"code": "position-gap", "severity": "error", "message": ALARM.message, "step": 3}


def test_old_records_read_with_their_defaults(monkeypatch):
    """Records written before a field existed: a token without its turn, a top token without its rank, a
    layer without seen / held_from or any field added later, a step without phase, turn or timings."""
    monkeypatch.setitem(CODES, "c", Code("c", ("info",), "info", "a test's code"))  # any registered code
    token = from_record(BufferToken, {"position": 4, "id": 9, "piece": "x", "special": False, "origin": "user"})
    assert token == BufferToken(4, 9, "x", False, "user", 0)
    assert from_record(TopToken, {"id": 9, "text": "x", "logit": 1.0, "prob": 0.5}) == TopToken(9, "x", 1.0, 0.5, 0)
    old_layer = {
        "index": 0,
        "kind": "full",
        "k_shape": [1, 2, 3, 8],
        "v_shape": [1, 2, 3, 8],
        "dtype": "float32",
        "device": "cpu",
        "bytes": 384,
        "filled": 3,
    }
    layer = from_record(LayerInfo, old_layer)
    assert (layer.seen, layer.held_from, layer.capacity, layer.window, layer.states, layer.quant_bits) == (
        3,
        0,
        None,
        None,
        (),
        None,
    )
    old_step = {
        "type": "step",
        "step": 5,
        "input_ids": [9],
        "positions": [4],
        "cursor": 5,
        "cache_seq_length": 5,
        "layers": [old_layer],
        "topk": [{"id": 9, "text": "x", "logit": 1.0, "prob": 0.5}],
        "chosen": None,
        "diagnostics": [{"code": "c", "severity": "info", "message": "m"}],
    }
    step = from_record(StepSnapshot, old_step, buffer=TokenBuffer([token]))
    assert (step.phase, step.turn, step.forward_ms, step.source, step.topk_processed) == (
        "decode",
        0,
        0.0,
        "session",
        (),
    )
    assert step.diagnostics == (Diagnostic("c", "info", "m", 5),)  # a step's alarm takes the step's number
    assert from_record(Diagnostic, {"type": "diagnostic", "step": 2, "code": "c", "severity": "info", "message": "m"})


def test_the_shipped_trace_reads_and_writes_back_the_same_records():
    """A trace recorded by an earlier kvtui: each step line decodes, and encodes back to the same record
    (the layer fields added since then come back at their defaults)."""
    trace = read_trace(SAMPLE)
    replay = Replay(trace)
    assert len(replay) == len(trace.steps)
    for stored, snapshot in zip(trace.steps, replay.snapshots):
        again = to_record(snapshot)
        again["layers"] = [{k: layer[k] for k in old} for layer, old in zip(again["layers"], stored["layers"])]
        assert again == stored
    for stored in trace.buffers:
        assert buffer_record([from_record(BufferToken, t) for t in stored["tokens"]]) == stored
    for event in trace.events:
        if event["type"] == "verify":
            assert verify_record(from_record(VerifyResult, event), event["step"]) == event

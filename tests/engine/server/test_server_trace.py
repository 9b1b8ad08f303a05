"""Server traces (kvtui attach --trace): written as events arrive, replayed into the same prefix cache and notes,
a crash's cut tail tolerated, a corrupt line named, two runs compared (kvtui diff)."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest
from click.testing import CliRunner

from kvtui.cli import main
from kvtui.engine.reading.token_texts import TokenTexts
from kvtui.engine.server.kv_events import decode_message
from kvtui.engine.server.prefix_cache import PrefixCache
from kvtui.engine.server.server_http import CacheMetrics, ServerInfo
from kvtui.engine.server.server_trace import (
    ServerTraceError,
    ServerTraceWriter,
    diff_server_runs,
    is_server_trace,
    load_server_trace,
)

pytestmark = pytest.mark.version_free("a server's events, HTTP and traces, read by kvtui alone: no transformers code")

DATA = Path(__file__).resolve().parents[2] / "data" / "kv_events"


def record(path: Path, frames_used: int | None = None, lifetime: tuple[float, float] = (0.0, 0.0)) -> PrefixCache:
    """Apply the recorded vLLM events as the attach session does, writing the trace; the live cache."""
    pieces = json.loads((DATA / "smollm2-pieces.json").read_text())
    table = {int(k): v for k, v in pieces["pieces"].items()}
    texts = TokenTexts(lambda ids: {i: table[i] for i in ids if i in table}, pieces["special"])
    cache = PrefixCache(texts)
    writer = ServerTraceWriter(path, [ServerInfo("http://127.0.0.1:8000", "smollm2")], cache)
    frames = msgpack.unpackb((DATA / "vllm-0.32-maps.msgpack").read_bytes())[:frames_used]
    for number, frame in enumerate(frames):
        batch = decode_message(frame)
        notes = cache.apply(batch, "127.0.0.1:8000")
        writer.batch("127.0.0.1:8000", batch, notes)
        if number in (3, 5):  # `lifetime`: what the server counted before kvtui attached
            queries, hits = lifetime[0] + 500.0 * (number - 2), lifetime[1] + 192.0 * (number - 2)
            metrics = CacheMetrics(queries=queries, hits=hits, capacity=40, block_size=32)
            cache.record_metrics("127.0.0.1:8000", float(number), metrics)
            writer.metrics("127.0.0.1:8000", float(number), metrics)
    writer.close()
    return cache


def test_replay_rebuilds_the_same_cache_and_notes_without_a_tokenizer(tmp_path):
    path = tmp_path / "run.jsonl"
    live = record(path)
    assert is_server_trace(path)
    run = load_server_trace(path)
    assert [(n.code, n.message) for n in run.cache.notes] == [(n.code, n.message) for n in live.notes]
    assert [r["message"] for r in run.recorded_notes] == [n.message for n in live.notes]
    assert "'Time' (id 7487)" in run.cache.notes[0].message  # the texts came from the trace
    assert set(run.cache.blocks) == set(live.blocks) and run.cache.stats("127.0.0.1:8000").capacity == 40
    assert run.servers[0]["model"] == "smollm2"


def test_a_cut_tail_is_dropped_and_a_corrupt_line_is_named(tmp_path):
    path = tmp_path / "run.jsonl"
    record(path)
    data = path.read_bytes()
    cut = tmp_path / "cut.jsonl"
    last = data.rstrip(b"\n").rsplit(b"\n", 1)[1]
    cut.write_bytes(data[: len(data) - 40])  # killed mid-line (the last line: a batch, or a note it raised)
    whole, part = load_server_trace(path), load_server_trace(cut)
    if json.loads(last)["type"] == "batch":
        assert part.batches == whole.batches - 1
    else:
        assert part.batches == whole.batches and len(part.recorded_notes) == len(whole.recorded_notes) - 1
    bad = tmp_path / "bad.jsonl"
    lines = data.split(b"\n")
    lines[3] = b"{not json"
    bad.write_bytes(b"\n".join(lines))
    with pytest.raises(ServerTraceError, match=r"bad.jsonl:4: not a JSON line"):
        load_server_trace(bad)
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"type": "header", "schema": 1}\n')
    with pytest.raises(ServerTraceError, match="not a kvtui server trace"):
        load_server_trace(plain)


def test_diff_of_two_runs(tmp_path):
    full, part = tmp_path / "full.jsonl", tmp_path / "part.jsonl"
    record(full)
    record(part, frames_used=2)  # only the first request and the timestamped one
    assert diff_server_runs(load_server_trace(full), load_server_trace(full)) == []
    lines = diff_server_runs(load_server_trace(full), load_server_trace(part))
    assert any(line.startswith("notes: A has") for line in lines)
    assert any(line.startswith("blocks stored: A ") for line in lines)
    runner = CliRunner()
    same = runner.invoke(main, ["diff", str(full), str(full)])
    assert same.exit_code == 0 and "agree" in same.output
    differ = runner.invoke(main, ["diff", str(full), str(part)])
    assert differ.exit_code == 1 and "differ" in differ.output
    # the same events seen by two runs attached at different points of the server's life: the lifetime counters
    # moved, the rate over what each watched did not: no difference
    later = tmp_path / "later.jsonl"
    record(later, lifetime=(10_000.0, 9_000.0))
    assert diff_server_runs(load_server_trace(full), load_server_trace(later)) == []
    lines = diff_server_runs(load_server_trace(full), load_server_trace(part))
    assert "hit rate while watched: A 38.4%, B None" in lines  # as % like the rest
    mixed = tmp_path / "steps.jsonl"
    mixed.write_text('{"type": "header", "schema": 1}\n')
    assert runner.invoke(main, ["diff", str(full), str(mixed)]).exit_code == 2

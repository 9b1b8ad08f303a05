"""KV cache events as vLLM 0.32 published them (recorded from a real server: tests/data/kv_events) and as SGLang
encodes the same events (arrays; make_sglang_arrays.py), decoded and folded into the prefix cache."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest

from kvtui.engine.reading.token_texts import TokenTexts
from kvtui.engine.server.kv_events import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    EventBatch,
    UndecodablePayload,
    block_key,
    decode_message,
    decode_payload,
    encode_batch,
)
from kvtui.engine.server.prefix_cache import PrefixCache
from kvtui.engine.server.report import summary_lines
from kvtui.engine.server.server_http import parse_metrics

pytestmark = pytest.mark.version_free("a server's events, HTTP and traces, read by kvtui alone: no transformers code")

DATA = Path(__file__).resolve().parents[2] / "data" / "kv_events"


def frames(name: str) -> list[list[bytes]]:
    return msgpack.unpackb((DATA / name).read_bytes())


def recorded_texts() -> TokenTexts:
    data = json.loads((DATA / "smollm2-pieces.json").read_text())
    texts = TokenTexts()
    texts.learn({int(k): v for k, v in data["pieces"].items()}, data["special"])
    return texts


def test_both_encodings_decode_to_the_same_events():
    maps = [decode_message(f) for f in frames("vllm-0.32-maps.msgpack")]
    arrays = [decode_message(f) for f in frames("sglang-arrays.msgpack")]
    assert len(maps) == len(arrays) == 15
    assert [b.seq for b in maps] == list(range(15))
    for a, b in zip(maps, arrays, strict=True):
        assert len(a.events) == len(b.events)
        for x, y in zip(a.events, b.events, strict=True):
            assert type(x) is type(y)
            if isinstance(x, BlocksStored):
                assert (x.hashes, x.parent, x.token_ids) == (y.hashes, y.parent, y.token_ids)
                assert x.block_size == y.block_size
                assert x.medium == "GPU" and y.medium is None  # SGLang's schema has no medium
            elif isinstance(x, BlocksRemoved):
                assert x.hashes == y.hashes


def test_decoded_events_match_the_raw_payloads():
    """Counted independently from the raw msgpack maps."""
    stored = removed = cleared = 0
    for f in frames("vllm-0.32-maps.msgpack"):
        for raw in msgpack.unpackb(f[2])[1]:
            stored += len(raw.get("block_hashes", [])) if raw["type"] == "BlockStored" else 0
            removed += len(raw["block_hashes"]) if raw["type"] == "BlockRemoved" else 0
            cleared += raw["type"] == "AllBlocksCleared"
    batches = [decode_message(f) for f in frames("vllm-0.32-maps.msgpack")]
    events = [e for b in batches for e in b.events]
    assert stored == sum(len(e.hashes) for e in events if isinstance(e, BlocksStored)) > 0
    assert removed == sum(len(e.hashes) for e in events if isinstance(e, BlocksRemoved)) > 0
    assert cleared == sum(isinstance(e, AllCleared) for e in events) == 1
    first = msgpack.unpackb(frames("vllm-0.32-maps.msgpack")[0][2])[1][0]
    assert batches[0].events[0].hashes[0] == f"{first['block_hashes'][0]:016x}"
    assert batches[0].events[0].block_size == 32


@pytest.mark.parametrize("arrays", [False, True])
def test_encode_round_trip(arrays):
    batch = EventBatch(
        seq=3,
        ts=1.5,
        events=(
            BlocksStored(("00000000000000aa", "00000000000000bb"), None, tuple(range(8)), 4, 0, "GPU"),
            BlocksRemoved(("00000000000000aa",), None, "GPU"),
            AllCleared(),
        ),
        dp_rank=1,
    )
    back = decode_payload(encode_batch(batch, arrays=arrays), seq=3)
    assert back.events[0].hashes == batch.events[0].hashes
    assert back.events[0].token_ids == batch.events[0].token_ids
    assert isinstance(back.events[2], AllCleared) and back.dp_rank == 1


def stored_payload(hashes, tokens, size) -> bytes:
    event = {"type": "BlockStored", "block_hashes": hashes, "token_ids": tokens, "block_size": size}
    return msgpack.packb([1.0, [event]])


@pytest.mark.parametrize(
    "payload, says",
    [
        (b"\xc1\xc1", "not msgpack"),
        (msgpack.packb({"x": 1}), "not an event batch"),
        (stored_payload(hashes=[1], tokens=[1], size=0), "block_size"),
        (stored_payload(hashes=[1, 2], tokens=[1, 2], size=2), "2 blocks"),
        (msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": 5}]]), "not a list"),
        (msgpack.packb([1.0, [7]]), "no type"),
    ],
)
def test_bad_payloads_say_what_is_wrong(payload, says):
    with pytest.raises(UndecodablePayload, match=says):
        decode_payload(payload)


def test_unknown_event_types_are_counted_not_lost():
    batch = decode_payload(msgpack.packb([1.0, [{"type": "BlockMoved"}, ["AllBlocksCleared"]]]))
    assert batch.skipped == 1 and isinstance(batch.events[0], AllCleared)


def test_block_keys_are_the_same_for_ints_and_bytes():
    assert block_key(0xABC) == "0000000000000abc"
    assert block_key(b"\x01\x02") == "0102"
    with pytest.raises(UndecodablePayload):
        block_key(None)


def apply_recorded(name: str, **kwargs) -> PrefixCache:
    cache = PrefixCache(recorded_texts(), **kwargs)
    for f in frames(name):
        cache.apply(decode_message(f), "server")
    return cache


@pytest.mark.parametrize("name", ["vllm-0.32-maps.msgpack", "sglang-arrays.msgpack"])
def test_the_recorded_misses_are_named_at_their_token(name):
    cache = apply_recorded(name)
    misses = [n for n in cache.notes if n.code == "recomputed-prefix"]
    first = misses[0]
    assert first.where.position == 3 and first.where.chain == 1
    assert "'Time' (id 7487) instead of 'You' (id 2683)" in first.message
    assert "'Time: 12:01.' was put before the cached text" in first.message
    varying = [n for n in cache.notes if n.code == "varying-start"]
    assert varying and "'Request 1f3a.', 'Time: 12:01.'" in varying[0].message
    assert not [n for n in cache.notes if n.code in ("template-drift", "cache-churn")]


@pytest.mark.parametrize("name", ["vllm-0.32-maps.msgpack", "sglang-arrays.msgpack"])  # SGLang names no group
def test_blocks_held_follow_the_events(name):
    """Held = stored - removed, restarted at the clear: counted here from the raw payloads, independently."""
    held: set[int] = set()
    for f in frames("vllm-0.32-maps.msgpack"):
        for raw in msgpack.unpackb(f[2])[1]:
            if raw["type"] == "BlockStored":
                held.update(raw["block_hashes"])
            elif raw["type"] == "BlockRemoved":
                held.difference_update(raw["block_hashes"])
            else:
                held.clear()
    cache = apply_recorded(name)
    stats = cache.stats("server")
    assert stats.held == cache.held == len(held)
    assert {int(k, 16) for _, _, k in cache.blocks} == held
    assert stats.cleared == 1 and stats.removed > 0 and stats.lost == 0
    assert any("blocks held" in line for line in summary_lines(cache))


def test_a_chain_is_its_blocks_in_order():
    cache = PrefixCache(TokenTexts())
    cache.apply(EventBatch(0, 0.0, (BlocksStored(("a1", "a2", "a3", "a4"), None, tuple(range(32)), 8),)))
    changed = (16, 17, 99, *range(19, 32))  # one token replaced, the rest as cached
    cache.apply(EventBatch(1, 0.0, (BlocksStored(("b3", "b4"), "a2", changed, 8),)))  # branches after a2
    blocks = cache.chain_blocks(1)
    assert [b.key for b in blocks] == ["a1", "a2", "a3", "a4", "b3", "b4"]
    assert [b.depth for b in blocks] == [0, 1, 2, 3, 2, 3]
    (note,) = cache.notes
    assert (
        note.code == "recomputed-prefix"
        and note.where.position == 18
        and note.where.chain == 1
        and note.where.block == "b3"
    )
    assert "14 tokens after it were prefilled again" in note.message


def test_another_question_after_a_shared_prefix_is_no_miss():
    """The blocks after a shared system prompt differ because the question does: no waste, no note."""
    cache = PrefixCache(TokenTexts())
    cache.apply(EventBatch(0, 0.0, (BlocksStored(("a1", "a2"), None, tuple(range(16)), 8),)))
    cache.apply(EventBatch(1, 0.0, (BlocksStored(("b2",), "a1", (8, 9, 10, 50, 51, 52, 53, 54), 8),)))
    assert cache.notes == [] and [b.key for b in cache.chain_blocks(1)] == ["a1", "a2", "b2"]


def test_memory_stays_bounded_and_what_is_let_go_is_counted():
    cache = PrefixCache(TokenTexts(), max_blocks=50)
    for i in range(200):
        cache.apply(EventBatch(i, 0.0, (BlocksStored((f"{i:016x}",), None, (i, i + 1), 2),)))
    assert cache.held == 50 and cache.let_go == 150
    assert cache.stats("").held == 200  # the server still holds them: it said nothing else
    cache.apply(EventBatch(200, 0.0, (BlocksRemoved((f"{0:016x}",)),)))  # one kvtui let go
    assert cache.stats("").held == 199 and cache.stats("").unknown_removed == 1


def test_a_gap_in_sequence_numbers_is_counted_as_lost():
    cache = PrefixCache(TokenTexts())
    cache.apply(EventBatch(0, 0.0, ()))
    cache.apply(EventBatch(5, 0.0, ()))
    assert cache.stats("").lost == 4


def test_churn_is_noted_once():
    cache = PrefixCache(TokenTexts())
    seq = 0
    for _ in range(10):
        cache.apply(EventBatch(seq, 1.0, (BlocksStored(("aa",), None, (1, 2), 2),)))
        cache.apply(EventBatch(seq + 1, 2.0, (BlocksRemoved(("aa",)),)))
        seq += 2
    churn = [n for n in cache.notes if n.code == "cache-churn"]
    assert len(churn) == 1 and "stored again within 60 s" in churn[0].message
    assert cache.stats("").restored == 9


def test_template_drift_is_told_from_a_text_difference():
    texts = TokenTexts()
    texts.learn({1: "<|im_start|>", 2: "<|im_end|>", 10: "Hi", 11: " there", 12: "\n", 13: "Bye"}, special=[1, 2])
    cache = PrefixCache(texts)
    cached = (10, 11, 2, 12, 10, 11, 12, 10, 11, 12)
    cache.apply(EventBatch(0, 0.0, (BlocksStored(("a",), None, cached, 10),)))
    cache.apply(EventBatch(1, 0.0, (BlocksStored(("b",), None, (10, 11, 12, 10, 11, 12, 10, 11, 12, 10), 10),)))
    cache.apply(EventBatch(2, 0.0, (BlocksStored(("c",), None, (10, 13, *cached[2:]), 10),)))  # one word differs
    assert [n.code for n in cache.notes] == ["template-drift", "recomputed-prefix"]
    assert "'<|im_end|>' (id 2)" in cache.notes[0].message


def test_metrics_of_a_real_server_parse():
    metrics = parse_metrics((DATA / "vllm-0.32-metrics.txt").read_text())
    assert metrics.capacity == 40 and metrics.block_size == 32
    assert metrics.queries and metrics.hits is not None and 0 <= metrics.hits <= metrics.queries
    cache = PrefixCache(TokenTexts())
    cache.record_metrics("s", 1.0, metrics)
    sample = cache.record_metrics("s", 2.0, metrics)
    assert sample.rate is None  # no new queries between the two polls
    assert sample.overall == pytest.approx(metrics.hits / metrics.queries)


def test_discover_reads_a_real_servers_event_sources():
    """/kv_event_sources as vLLM 0.32 answered it: the bind address dialled at the server's host, with replay."""
    import http.server
    import threading

    from kvtui.engine.server.server_http import discover

    sources = (DATA / "vllm-0.32-kv_event_sources.json").read_bytes()

    class Server(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = sources if self.path == "/kv_event_sources" else b'{"data": [{"id": "smollm2", "root": "/m"}]}'
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        info = discover(f"127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
    (endpoint,) = info.endpoints
    assert info.model == "smollm2" and info.root == "/m"
    assert endpoint.endpoint == "tcp://127.0.0.1:5557" and endpoint.replay == "tcp://127.0.0.1:5558"
    assert endpoint.topic == "kv-events" and endpoint.origin == f"127.0.0.1:{server.server_port}"


def test_varying_start_remembers_a_bounded_number_of_places(monkeypatch):
    """A long watch stays bounded: past MISSES_KEPT places the oldest is forgotten, and the recorded misses are
    still named (the places they left are the newest)."""
    from kvtui.engine.server import rules

    monkeypatch.setattr(rules, "MISSES_KEPT", 1)
    cache = apply_recorded("vllm-0.32-maps.msgpack")
    assert list(cache.rules._misses) == [("server", 7, 4)]  # of 4 places, the newest
    varying = [n for n in cache.notes if n.code == "varying-start"]
    assert varying and "'Request 1f3a.', 'Time: 12:01.'" in varying[0].message

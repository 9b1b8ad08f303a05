"""Each prefill as one request's row (server/requests.py): hits reported by the server where a client sent
`kv_cache_report_mode: full` (vLLM 0.32 then announces the reused blocks as a BlockStored from the prompt's first
block, all held already, before the request's new blocks, both with the client's session), hits inferred from the
chain where it did not; the events are shaped as a vLLM 0.32 server sent them here (block size 32, 138-token
prompts: the probe in the helper's report)."""

from __future__ import annotations

import pytest

from kvtui.engine.reading.token_texts import TokenTexts
from kvtui.engine.server.kv_events import BlocksStored, EventBatch, decode_payload, encode_batch
from kvtui.engine.server.prefix_cache import PrefixCache
from kvtui.engine.server.report import summary_lines
from kvtui.engine.server.server_trace import event_from_record, event_record
from kvtui.engine.server.subscriber import EventEndpoint
from kvtui.engine.server.view import stats_view
from local_publisher import LocalPublisher
from waiting import following, wait_for

pytestmark = pytest.mark.version_free("a server's events, HTTP and traces, read by kvtui alone: no transformers code")

SIZE = 32
SYSTEM = tuple(range(1000, 1096))  # 3 blocks the questions share
RENT = SYSTEM + tuple(range(2000, 2032))  # + a question's block
OPEN = SYSTEM + tuple(range(3000, 3032))
H = ["a0", "a1", "a2", "a3"]  # hex: they go through the wire too


def stored(keys, tokens, parent=None, session=None) -> BlocksStored:
    return BlocksStored(tuple(keys), parent, tuple(tokens), SIZE, medium="GPU", session=session)


def apply(cache: PrefixCache, seq: int, *events, origin: str = "127.0.0.1:8000"):
    return cache.apply(EventBatch(seq, 100.0 + seq, tuple(events)), origin)


def facts(cache: PrefixCache) -> list[tuple]:
    return [(r.session, r.hit, r.reported, r.new, r.cause) for r in reversed(cache.requests.newest(50))]


def test_reported_hits_are_the_servers_word_and_no_block_is_stored_again():
    cache = PrefixCache(TokenTexts())
    apply(cache, 0, stored(H, RENT, session="s-1"))  # first: nothing cached, no report (vLLM sends none for 0 hits)
    apply(cache, 1, stored(H, RENT, session="s-2"))  # the same prompt: its 4 blocks reported, nothing new
    # another question: 3 blocks reported, then its new block going on from the last of them (one batch)
    apply(cache, 2, stored(H[:3], SYSTEM, session="s-3"), stored(["q0"], OPEN[96:], parent="a2", session="s-3"))
    assert facts(cache) == [("s-1", 0, False, 128, None), ("s-2", 128, True, 0, None), ("s-3", 96, True, 32, None)]
    stats = cache.stats("127.0.0.1:8000")
    assert (stats.stored_again, stats.stored, stats.held) == (0, 5, 5)
    assert (stats.requests, stats.reports, stats.reported_hits, stats.inferred_hits) == (3, 2, 224, 0)
    # a reported hit counts once on the blocks (a2: the two reports; no second count for q0 going on from it)
    assert [cache.blocks[("127.0.0.1:8000", 0, k)].hits for k in H] == [2, 2, 2, 1]
    line = next(line for line in summary_lines(cache) if "requests 3" in line)
    assert "hits reported by the server 224 tokens (2 requests sent with kv_cache_report_mode full)" in line
    assert cache.notes == []


def test_without_a_report_hits_are_inferred_from_the_chain_and_a_whole_prompt_hit_is_unseen():
    cache = PrefixCache(TokenTexts())
    apply(cache, 0, stored(H, RENT))
    # the same prompt again: vLLM announces nothing (all of it hit): no row
    apply(cache, 1, stored(["q0"], OPEN[96:], parent="a2"))  # another question: its first 96 tokens were held
    apply(cache, 2, stored(["g0"], range(5000, 5032), parent="q0"))  # the same request decoding on (a full block)
    apply(cache, 3, stored(["o0"], range(7000, 7032), parent="missing"))  # its chain began before kvtui attached
    assert facts(cache) == [(None, 0, False, 128, None), (None, 96, False, 64, None), (None, None, False, 32, None)]
    view = stats_view(cache)
    assert [r.hit for r in view.requests] == [None, 96, 0]  # newest first
    assert (cache.stats("127.0.0.1:8000").inferred_hits, cache.stats("127.0.0.1:8000").reports) == (96, 0)


def test_a_session_tells_two_requests_apart_where_their_blocks_go_on_from_one_another():
    cache = PrefixCache(TokenTexts())
    apply(cache, 0, stored(H, RENT, session="a"))
    apply(cache, 1, stored(["n0"], range(4000, 4032), parent="a3", session="b"))  # another session, from a's leaf
    apply(cache, 2, stored(["n1"], range(4100, 4132), parent="n0", session="b"))  # b's next chunk
    assert facts(cache) == [("a", 0, False, 128, None), ("b", 128, False, 64, None)]


def test_a_miss_cause_is_on_the_requests_row():
    cache = PrefixCache(TokenTexts())
    apply(cache, 0, stored(H, RENT, session="s-1"), origin="r1")
    apply(cache, 1, stored(["x0", "x1", "x2", "x3"], RENT, session="s-2"), origin="r2")  # r1 held it
    (row,) = [r for r in cache.requests.newest(5) if r.origin == "r2"]
    assert (row.hit, row.reported, row.new, row.cause) == (0, False, 128, "held-elsewhere")


def test_the_session_goes_through_the_wire_and_the_trace():
    event = stored(H, RENT, session="s-9")
    assert decode_payload(encode_batch(EventBatch(0, 1.0, (event,)))).events == (event,)
    assert event_from_record(event_record(event)) == event
    cache, problems = PrefixCache(TokenTexts()), []
    with LocalPublisher() as publisher:
        endpoint = EventEndpoint(publisher.endpoint, publisher.replay_endpoint, "kv-events", 0, "local")
        with following(cache, [endpoint], [publisher], problems):
            publisher.publish(encode_batch(EventBatch(0, 1.0, (event,))))
            publisher.publish(encode_batch(EventBatch(1, 2.0, (stored(H, RENT, session="s-10"),))))
            assert wait_for(lambda: cache.stats("local").batches == 2)
    assert facts(cache) == [("s-9", 0, False, 128, None), ("s-10", 128, True, 0, None)] and not problems

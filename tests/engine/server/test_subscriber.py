"""The subscriber against a publisher speaking vLLM's protocol (kvtui's LocalPublisher): catch-up through replay,
gaps filled or counted, bad payloads reported and skipped, every event applied or counted."""

from __future__ import annotations

import threading

import pytest

from kvtui.engine.reading.token_texts import TokenTexts
from kvtui.engine.server.kv_events import BlocksStored, EventBatch, encode_batch
from kvtui.engine.server.prefix_cache import PrefixCache
from kvtui.engine.server.server_http import EventEndpoint
from kvtui.engine.server.subscriber import Subscriber
from local_publisher import LocalPublisher
from waiting import wait_for

pytestmark = pytest.mark.version_free("a server's events, HTTP and traces, read by kvtui alone: no transformers code")


def payload(i: int) -> bytes:
    return encode_batch(EventBatch(i, float(i), (BlocksStored((f"{i:016x}",), None, (i, i + 1), 2),)))


def start(publisher: LocalPublisher, cache: PrefixCache, problems: list, batches: list | None = None):
    endpoint = EventEndpoint(publisher.endpoint, publisher.replay_endpoint, "kv-events", 0, "local")
    subscriber = Subscriber(
        [endpoint],
        cache,
        on_batch=(lambda origin, batch, notes: batches.append(batch.seq)) if batches is not None else None,
        on_problem=problems.append,
    )
    thread = threading.Thread(target=subscriber.run, daemon=True)
    thread.start()
    assert subscriber.connected.wait(5)
    assert publisher.wait_subscribed()  # a SUB socket's subscription reaches the PUB side a moment after connecting
    return subscriber, thread


def test_catch_up_and_a_gap_are_filled_through_replay():
    cache, problems, batches = PrefixCache(TokenTexts()), [], []
    with LocalPublisher() as publisher:
        publisher.publish(payload(0))  # before kvtui attached: only replay has it
        subscriber, thread = start(publisher, cache, problems, batches)
        assert wait_for(lambda: 0 in batches)
        publisher.publish(payload(1))
        publisher.publish(payload(2), live=False)  # the subscriber misses it live
        publisher.publish(payload(3))
        assert wait_for(lambda: 3 in batches)
        subscriber.stop.set()
        thread.join(5)
    assert batches == [0, 1, 2, 3]
    stats = cache.stats("local")
    assert stats.stored == 4 and stats.lost == 0 and subscriber.replayed >= 2
    assert not problems


def test_batches_dropped_at_the_end_of_a_burst_come_through_replay_once_the_server_is_quiet():
    """No later batch shows a gap at the end of a burst (an idle server sends none): the quiet origin's replay
    socket is asked once what followed the last batch applied."""
    cache, problems, batches = PrefixCache(TokenTexts()), [], []
    with LocalPublisher() as publisher:
        subscriber, thread = start(publisher, cache, problems, batches)
        publisher.publish(payload(0))
        assert wait_for(lambda: 0 in batches)
        publisher.publish(payload(1))
        publisher.publish(payload(2), live=False)  # dropped live, and nothing comes after them
        publisher.publish(payload(3), live=False)
        assert wait_for(lambda: 3 in batches)
        publisher.publish(payload(4))  # live again: no batch twice
        assert wait_for(lambda: 4 in batches)
        subscriber.stop.set()
        thread.join(5)
    assert batches == [0, 1, 2, 3, 4]
    stats = cache.stats("local")
    assert stats.stored == 5 and stats.lost == 0 and subscriber.replayed == 2 and subscriber.duplicates == 0
    assert not problems


def test_a_gap_without_replay_is_counted_as_lost():
    cache, problems, batches = PrefixCache(TokenTexts()), [], []
    with LocalPublisher(replay=False) as publisher:
        subscriber, thread = start(publisher, cache, problems, batches)
        publisher.publish(payload(0))
        publisher.publish(payload(1), live=False)
        publisher.publish(payload(2), live=False)
        publisher.publish(payload(3))
        assert wait_for(lambda: 3 in batches)
        subscriber.stop.set()
        thread.join(5)
    stats = cache.stats("local")
    assert batches == [0, 3] and stats.lost == 2 and stats.stored == 2


def test_a_payload_that_does_not_decode_is_reported_and_skipped():
    cache, problems, batches = PrefixCache(TokenTexts()), [], []
    with LocalPublisher(replay=False) as publisher:
        subscriber, thread = start(publisher, cache, problems, batches)
        publisher.publish(b"\xc1 not msgpack")
        publisher.publish(payload(1))
        assert wait_for(lambda: 1 in batches)
        subscriber.stop.set()
        thread.join(5)
    assert len(problems) == 1 and "did not decode" in problems[0].message and "skipped" in problems[0].message
    assert subscriber.undecodable == 1 and cache.stats("local").skipped == 1 and cache.stats("local").stored == 1


def test_data_parallel_ranks_are_origins_of_one_view():
    """`--events tcp://HOST:PORT --dp-ranks 2`: rank r publishes on PORT + r; each its own origin, one cache."""
    from kvtui.engine.server.server_http import given_endpoints

    cache, problems, batches = PrefixCache(TokenTexts()), [], []
    with LocalPublisher(replay=False) as rank0, LocalPublisher(replay=False) as rank1:
        endpoints = [
            EventEndpoint(rank0.endpoint, None, "kv-events", 0, "127.0.0.1:8000"),
            EventEndpoint(rank1.endpoint, None, "kv-events", 1, "127.0.0.1:8000/dp1"),
        ]
        subscriber = Subscriber(endpoints, cache, lambda o, b, n: batches.append((o, b.seq)), problems.append)
        thread = threading.Thread(target=subscriber.run, daemon=True)
        thread.start()
        assert subscriber.connected.wait(5)
        assert rank0.wait_subscribed() and rank1.wait_subscribed()
        rank0.publish(payload(0))
        rank1.publish(payload(0))  # the same sequence number and hash on another rank: another cache
        rank1.publish(payload(1))
        assert wait_for(lambda: len(batches) == 3)
        subscriber.stop.set()
        thread.join(5)
    assert cache.stats("127.0.0.1:8000").stored == 1 and cache.stats("127.0.0.1:8000/dp1").stored == 2
    assert cache.held == 3 and not problems
    ranks = given_endpoints("tcp://10.0.0.5:5557", 3, "kv-events")
    assert [e.endpoint for e in ranks] == ["tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", "tcp://10.0.0.5:5559"]
    assert [e.origin for e in ranks] == ["10.0.0.5:5557", "10.0.0.5:5557/dp1", "10.0.0.5:5557/dp2"]

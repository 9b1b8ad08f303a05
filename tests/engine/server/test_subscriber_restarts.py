"""Publishers that restart, go away and come back, against kvtui's LocalPublisher (vLLM's protocol) restarted on the
same ports: each restart is a new epoch (the old process's blocks are gone, the new sequence is followed from its
first batch, never taken for a duplicate), replay/live overlap is applied once, a data-parallel rank restarts
alone, and the faults around it (replay absent, unknown event types, two viewers, an outage) are each said once
with nothing lost."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest

from kvtui.engine.reading.token_texts import TokenTexts
from kvtui.engine.server.attach import AttachOptions, AttachSession, connect
from kvtui.engine.server.kv_events import BlocksStored, EventBatch, encode_batch
from kvtui.engine.server.prefix_cache import PrefixCache
from kvtui.engine.server.server_http import EventEndpoint
from kvtui.engine.server.server_trace import load_server_trace
from kvtui.engine.server.subscriber import Subscriber
from local_publisher import LocalPublisher
from waiting import wait_for

pytestmark = pytest.mark.version_free("a server's events, HTTP and traces, read by kvtui alone: no transformers code")

ORIGIN = "local"


def payload(life: int, seq: int) -> bytes:
    """Batch `seq` of publisher process `life`: one block whose hash and tokens say which (ts too, as a server's)."""
    key = f"{life:04x}{seq:012x}"
    return encode_batch(EventBatch(seq, 1000.0 * life + seq, (BlocksStored((key,), None, (life, seq), 2),)))


class Follower:
    """A Subscriber on its thread, recording what it applied (origin, seq, block keys), its lines and its links."""

    def __init__(self, endpoints: list[EventEndpoint], catch_up: bool = True):
        self.cache = PrefixCache(TokenTexts())
        self.applied: list[tuple[str, int, tuple[str, ...]]] = []
        self.problems: list = []
        self.links: list[tuple[str, bool]] = []
        self.subscriber = Subscriber(
            endpoints,
            self.cache,
            on_batch=lambda o, b, n: self.applied.append(
                (o, b.seq, tuple(e.hashes[0] for e in b.events if getattr(e, "hashes", None)))
            ),
            on_problem=self.problems.append,
            catch_up=catch_up,
            on_link=lambda origin, up, detail: self.links.append((origin, up)),
        )
        self.thread = threading.Thread(target=self.subscriber.run, daemon=True)
        self.thread.start()
        assert self.subscriber.connected.wait(5)

    def connected(self, *publishers: LocalPublisher, count: int = 1) -> None:
        """Wait until the subscriptions reached the publishers (a SUB joins a moment after connecting: ZeroMQ's
        slow joiner would drop a batch sent before)."""
        epochs = self.subscriber._epochs
        assert wait_for(lambda: len(epochs) >= len(publishers) and all(e.connected for e in epochs.values())), epochs
        for publisher in publishers:
            assert publisher.wait_subscribed(count)

    def stop(self) -> None:
        self.subscriber.stop.set()
        self.thread.join(5)
        assert not self.thread.is_alive()

    def restarts(self) -> list[str]:
        return [p.message for p in self.problems if p.restart]

    def seqs(self, origin: str = ORIGIN) -> list[int]:
        return [seq for o, seq, _ in self.applied if o == origin]


def endpoint(publisher: LocalPublisher, origin: str = ORIGIN, rank: int = 0) -> EventEndpoint:
    return EventEndpoint(publisher.endpoint, publisher.replay_endpoint, "kv-events", rank, origin)


def restart(publisher: LocalPublisher, replay: bool = True) -> LocalPublisher:
    """Kill it and start another process's publisher on the same ports (its sequence starts at 0 again)."""
    port, replay_port = publisher.port, publisher.replay_port
    publisher.close()
    return LocalPublisher(replay=replay, port=port, replay_port=replay_port)


def held_keys(cache: PrefixCache, origin: str = ORIGIN) -> set[str]:
    return {key for (o, _group, key) in cache.blocks if o == origin}


def keys_of(life: int, seqs) -> set[str]:
    return {f"{life:04x}{seq:012x}" for seq in seqs}


def check_restart(old_batches: int, replay: bool) -> None:
    publisher = LocalPublisher(replay=replay)
    follower = Follower([endpoint(publisher)])
    try:
        follower.connected(publisher)
        for seq in range(old_batches):
            publisher.publish(payload(1, seq))
        assert wait_for(lambda: len(follower.applied) == old_batches)
        publisher = restart(publisher, replay)
        assert wait_for(lambda: (ORIGIN, True) in follower.links)  # ZeroMQ reconnected by itself
        assert publisher.wait_subscribed()
        for seq in range(3):
            publisher.publish(payload(2, seq))
        assert wait_for(lambda: len(follower.applied) == old_batches + 3), follower.applied[-5:]
    finally:
        follower.stop()
        publisher.close()
    stats = follower.cache.stats(ORIGIN)
    assert follower.seqs() == [*range(old_batches), 0, 1, 2]  # the new epoch's 0 was not taken for a duplicate
    assert len(follower.restarts()) == 1, follower.problems
    assert f"blocks gone with the old process {old_batches}, no longer held" in follower.restarts()[0]
    assert held_keys(follower.cache) == keys_of(2, range(3))  # the old process's blocks are not held
    assert stats.held == 3 and stats.gone == old_batches and stats.restarts == 1 and stats.lost == 0
    assert follower.links == [(ORIGIN, False), (ORIGIN, True)]


def test_a_restart_after_one_batch_is_a_new_epoch():
    check_restart(1, replay=True)


def test_a_restart_after_500_batches_is_a_new_epoch():
    check_restart(500, replay=True)


def test_a_restart_without_a_replay_socket_is_told_by_the_sequence():
    check_restart(500, replay=False)


def test_a_restart_whose_first_batch_seen_is_above_the_old_numbers():
    """ZeroMQ's slow joiner: the new process's first batches reach no one (here: sent before kvtui reconnects, kept
    only for replay), and the first one kvtui sees (8) is above the old last (3). Its replay socket no longer
    holds the old batch 3 as it was: a new epoch, caught up from 0."""
    publisher = LocalPublisher()
    follower = Follower([endpoint(publisher)])
    try:
        follower.connected(publisher)
        for seq in range(4):
            publisher.publish(payload(1, seq))
        assert wait_for(lambda: len(follower.applied) == 4)
        port, replay_port = publisher.port, publisher.replay_port
        publisher.close()
        assert wait_for(lambda: (ORIGIN, False) in follower.links)
        publisher = LocalPublisher(port=port, replay_port=replay_port)
        for seq in range(8):
            publisher.publish(payload(2, seq), live=False)
        assert wait_for(lambda: (ORIGIN, True) in follower.links)
        assert publisher.wait_subscribed()
        publisher.publish(payload(2, 8))
        assert wait_for(lambda: len(follower.applied) == 4 + 9), follower.applied
    finally:
        follower.stop()
        publisher.close()
    assert follower.seqs() == [0, 1, 2, 3, *range(9)]
    assert len(follower.restarts()) == 1
    assert held_keys(follower.cache) == keys_of(2, range(9))
    stats = follower.cache.stats(ORIGIN)
    assert stats.lost == 0 and stats.gone == 4 and stats.held == 9


def test_a_late_joiner_catches_up_and_counts_nothing_lost():
    """kvtui attaches to a publisher that sent 500 batches: replay gives them all; without replay the first live
    batch (500) starts the view, and what came before kvtui attached is not counted lost."""
    for replay in (True, False):
        publisher = LocalPublisher(replay=replay)
        for seq in range(500):
            publisher.publish(payload(1, seq), live=False)
        follower = Follower([endpoint(publisher)])
        try:
            follower.connected(publisher)
            publisher.publish(payload(1, 500))
            publisher.publish(payload(1, 501))
            assert wait_for(lambda f=follower: f.seqs()[-1:] == [501])
        finally:
            follower.stop()
            publisher.close()
        expected = list(range(502)) if replay else [500, 501]
        assert follower.seqs() == expected
        stats = follower.cache.stats(ORIGIN)
        assert stats.lost == 0 and stats.restarts == 0 and not follower.problems


def test_replay_and_live_overlap_is_applied_once():
    """What replay gave comes again live (the catch-up on attach overlaps the subscription): dropped, counted as
    duplicates; and a live batch under an old number that replay did not give is a restart, not a duplicate."""
    cache = PrefixCache(TokenTexts())
    applied, problems = [], []
    point = EventEndpoint("tcp://127.0.0.1:9", None, "kv-events", 0, ORIGIN)
    subscriber = Subscriber([point], cache, lambda o, b, n: applied.append(b.seq), problems.append)

    def frames(life, seq):
        return [b"kv-events", seq.to_bytes(8, "big"), payload(life, seq)]

    with cache.lock:
        for seq in range(5):
            subscriber._receive(point, frames(1, seq), live=False)  # the catch-up
        for seq in range(3, 8):
            subscriber._receive(point, frames(1, seq), live=True)  # the subscription, from before it ended
    assert applied == list(range(8)) and subscriber.duplicates == 2 and not problems
    with cache.lock:
        subscriber._receive(point, frames(2, 5), live=True)  # the same number, another process's batch
    assert applied[-1] == 5 and len(problems) == 1 and problems[0].restart
    stats = cache.stats(ORIGIN)
    assert stats.restarts == 1 and stats.gone == 8 and stats.held == 1
    assert stats.lost == 5  # the new process's 0..4 were never seen (no replay socket here): counted


def test_a_data_parallel_rank_restarts_alone():
    rank0, rank1 = LocalPublisher(), LocalPublisher()
    origins = ("srv:8000", "srv:8000/dp1")
    follower = Follower([endpoint(rank0, origins[0], 0), endpoint(rank1, origins[1], 1)])
    try:
        follower.connected(rank0, rank1)
        for seq in range(5):
            rank0.publish(payload(1, seq))
            rank1.publish(payload(1, seq))
        assert wait_for(lambda: len(follower.applied) == 10)
        rank1 = restart(rank1)
        assert wait_for(lambda: (origins[1], True) in follower.links)
        assert rank1.wait_subscribed()
        rank1.publish(payload(2, 0))
        rank0.publish(payload(1, 5))
        assert wait_for(lambda: len(follower.applied) == 12)
    finally:
        follower.stop()
        rank0.close()
        rank1.close()
    cache = follower.cache
    assert follower.seqs(origins[0]) == list(range(6)) and follower.seqs(origins[1]) == [*range(5), 0]
    assert held_keys(cache, origins[0]) == keys_of(1, range(6))  # rank 0 undisturbed
    assert held_keys(cache, origins[1]) == keys_of(2, [0])
    assert cache.stats(origins[0]).restarts == 0 and cache.stats(origins[1]).gone == 5
    assert [p.origin for p in follower.problems if p.restart] == [origins[1]]
    assert {origin for origin, _ in follower.links} == {origins[1]}


def test_the_servers_start_time_makes_one_epoch_not_two():
    """The HTTP side says the process changed: no second epoch where the sequence already began one; a new epoch
    where none began since (no replay socket here to tell, and the new process sent nothing yet)."""
    publisher = LocalPublisher(replay=False)
    follower = Follower([endpoint(publisher)])
    sub = follower.subscriber
    try:
        follower.connected(publisher)
        sub.server_identity([ORIGIN], 100.0)
        for seq in range(3):
            publisher.publish(payload(1, seq))
        assert wait_for(lambda: len(follower.applied) == 3)
        sub.server_identity([ORIGIN], 100.0)  # the same process
        publisher = restart(publisher, replay=False)
        assert wait_for(lambda: (ORIGIN, True) in follower.links)
        assert publisher.wait_subscribed()
        publisher.publish(payload(2, 0))
        assert wait_for(lambda: len(follower.restarts()) == 1)  # the sequence said it
        assert "its sequence went back from 2 to 0" in follower.restarts()[0]
        sub.server_identity([ORIGIN], 200.0)  # read after that: the same restart, no other epoch
        time.sleep(0.5)
        assert len(follower.restarts()) == 1
        publisher = restart(publisher, replay=False)
        assert wait_for(lambda: follower.links.count((ORIGIN, True)) == 2)
        sub.server_identity([ORIGIN], 300.0)  # before the new process sent anything: this says it
        assert wait_for(lambda: len(follower.restarts()) == 2)
        assert "the server's start time changed" in follower.restarts()[1]
        assert publisher.wait_subscribed()
        publisher.publish(payload(3, 0))
        publisher.publish(payload(3, 1))
        assert wait_for(lambda: len(follower.applied) == 6)
        time.sleep(0.3)
    finally:
        follower.stop()
        publisher.close()
    assert len(follower.restarts()) == 2 and held_keys(follower.cache) == keys_of(3, [0, 1])
    stats = follower.cache.stats(ORIGIN)
    assert (stats.restarts, stats.gone, stats.held, stats.lost) == (2, 4, 2, 0)


def test_an_absent_replay_socket_is_said_once_and_gaps_counted():
    publisher = LocalPublisher(replay=False)
    absent = EventEndpoint(publisher.endpoint, "tcp://127.0.0.1:9", "kv-events", 0, ORIGIN)
    follower = Follower([absent])
    try:
        follower.connected(publisher)
        for seq in range(12):
            publisher.publish(payload(1, seq), live=seq % 3 == 0)  # two of every three missed live
        assert wait_for(lambda: follower.seqs()[-1:] == [9], timeout=30)
    finally:
        follower.stop()
        publisher.close()
    lines = [p.message for p in follower.problems]
    assert len(lines) == 1 and "replay socket tcp://127.0.0.1:9 did not answer" in lines[0], lines
    assert follower.seqs() == [0, 3, 6, 9] and follower.cache.stats(ORIGIN).lost == 6


def test_unknown_event_types_are_named_once_and_counted():
    def strange(seq):
        return msgpack.packb(
            [1.0, [{"type": "BlockFrobbed", "x": 1}, {"type": "AllBlocksCleared"}, ["BlockShuffled", 3]], 0]
        )

    publisher = LocalPublisher(replay=False)
    follower = Follower([endpoint(publisher)])
    try:
        follower.connected(publisher)
        publisher.publish(payload(1, 0))
        publisher.publish(strange(1))
        publisher.publish(strange(2))
        publisher.publish(payload(1, 3))
        assert wait_for(lambda: len(follower.applied) == 4)
    finally:
        follower.stop()
        publisher.close()
    lines = [p.message for p in follower.problems]
    assert len(lines) == 1 and "(BlockFrobbed, BlockShuffled)" in lines[0], lines
    stats = follower.cache.stats(ORIGIN)
    assert stats.skipped == 4 and stats.cleared == 2 and stats.events == 8 and stats.held == 1


def test_two_viewers_on_one_publisher_see_everything_and_disturb_nothing():
    publisher = LocalPublisher()
    for seq in range(20):
        publisher.publish(payload(1, seq), live=False)
    first = Follower([endpoint(publisher)])
    try:
        first.connected(publisher)
        second = Follower([endpoint(publisher)])
        try:
            second.connected(publisher, count=2)
            for seq in range(20, 40):
                publisher.publish(payload(1, seq))
            assert wait_for(lambda: first.seqs()[-1:] == [39] and second.seqs()[-1:] == [39])
        finally:
            second.stop()
        publisher.publish(payload(1, 40))  # the second left: the first goes on
        assert wait_for(lambda: first.seqs()[-1:] == [40])
    finally:
        first.stop()
        publisher.close()
    assert first.seqs() == list(range(41)) and second.seqs() == list(range(40))
    assert not first.problems and not second.problems and not first.restarts()


def test_an_outage_is_said_once_and_the_restart_replays_from_the_trace(tmp_path):
    """`kvtui attach --events`: the publisher goes away (one line, the state for the screen), comes back as a new
    process (one line for the restart, one that it answers again); the trace replays to the same cache."""
    publisher = LocalPublisher()
    trace = tmp_path / "restart.jsonl"
    options = AttachOptions(events=publisher.endpoint, replay=publisher.replay_endpoint, trace=trace, metrics=False)
    session = AttachSession(options, connect(options))
    origin = session.endpoints[0].origin
    lines = []
    session.on_problem.append(lambda p: lines.append(p.message))
    session.start()
    try:
        assert wait_for(lambda: session.subscriber._epochs.get(origin) and session.subscriber._epochs[origin].connected)
        assert publisher.wait_subscribed()
        for seq in range(4):
            publisher.publish(payload(1, seq))
        assert wait_for(lambda: session.cache.stats(origin).batches == 4)
        port, replay_port = publisher.port, publisher.replay_port
        publisher.close()
        assert wait_for(lambda: session.unreachable())
        (outage,) = session.unreachable()
        assert outage.name == origin and len(outage.since_text) == 8
        time.sleep(1.0)  # ZeroMQ retries meanwhile: no line per retry
        assert len(lines) == 1 and f"{origin} unreachable since {outage.since_text}" in lines[0], lines
        publisher = LocalPublisher(port=port, replay_port=replay_port)
        assert wait_for(lambda: not session.unreachable())
        assert publisher.wait_subscribed()
        for seq in range(2):
            publisher.publish(payload(2, seq))
        assert wait_for(lambda: session.cache.stats(origin).batches == 6)
    finally:
        session.stop()
        publisher.close()
    assert len(lines) == 3, lines
    assert "answers again" in lines[1] or "answers again" in lines[2]
    assert sum("restarted" in line for line in lines) == 1
    live = session.cache.stats(origin)
    assert live.held == 2 and live.gone == 4 and live.restarts == 1
    replayed = load_server_trace(trace).cache
    again = replayed.stats(origin)
    assert (again.held, again.gone, again.restarts, again.lost, again.batches) == (2, 4, 1, 0, 6)
    assert set(replayed.blocks) == set(session.cache.blocks)


class Proxy:
    """A TCP relay between kvtui and a publisher: `cut()` drops the connections (a network blip: the publisher
    process lives on), `resume()` listens again on the same port."""

    def __init__(self, upstream: int):
        import socket

        self._socket = socket
        self.upstream = upstream
        self.port = 0
        self._open: list = []
        self._listener = None
        self.resume()

    def resume(self) -> None:
        listener = self._socket.socket()
        listener.setsockopt(self._socket.SOL_SOCKET, self._socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen()
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            server = self._socket.create_connection(("127.0.0.1", self.upstream))
            self._open += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source, sink) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for end in (source, sink):
            try:
                end.close()
            except OSError:
                pass

    def cut(self) -> None:
        try:
            self._listener.shutdown(self._socket.SHUT_RDWR)  # wakes its accept(): the port is free again
        except OSError:
            pass
        self._listener.close()
        for connection in self._open:
            try:
                connection.shutdown(self._socket.SHUT_RDWR)
                connection.close()
            except OSError:
                pass
        self._open.clear()


def test_a_network_blip_is_not_a_restart():
    """The connection drops and comes back to the same publisher process, which published meanwhile: its replay
    socket still holds the last batch kvtui applied, as it was, so it is the same epoch and replay fills the gap."""
    publisher = LocalPublisher()
    proxy = Proxy(publisher.port)
    relayed = EventEndpoint(f"tcp://127.0.0.1:{proxy.port}", publisher.replay_endpoint, "kv-events", 0, ORIGIN)
    follower = Follower([relayed])
    try:
        follower.connected(publisher)
        for seq in range(3):
            publisher.publish(payload(1, seq))
        assert wait_for(lambda: len(follower.applied) == 3)
        proxy.cut()
        assert wait_for(lambda: (ORIGIN, False) in follower.links)
        for seq in range(3, 6):
            publisher.publish(payload(1, seq))  # nobody subscribed: only replay has them
        proxy.resume()
        assert wait_for(lambda: (ORIGIN, True) in follower.links)
        assert wait_for(lambda: len(follower.applied) == 6)  # filled at the reconnect, through replay
        assert publisher.wait_subscribed(2)  # the same publisher: subscribed again
        publisher.publish(payload(1, 6))
        assert wait_for(lambda: len(follower.applied) == 7)
    finally:
        follower.stop()
        proxy.cut()
        publisher.close()
    assert follower.seqs() == list(range(7)) and not follower.restarts() and not follower.problems
    stats = follower.cache.stats(ORIGIN)
    assert stats.restarts == 0 and stats.lost == 0 and stats.held == 7


def test_a_slow_replay_socket_is_said_once_and_what_it_missed_counted():
    """A replay socket that answers after kvtui stopped waiting: one line, the gaps counted as lost, the late
    answers not applied out of turn."""
    import zmq

    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    replay_port = router.bind_to_random_port("tcp://127.0.0.1")
    done = threading.Event()

    def answer_late():
        while not done.is_set():
            if router.poll(50):
                client, _empty, start = router.recv_multipart()
                time.sleep(1.5)  # past REPLAY_WAIT_S
                seq = int.from_bytes(start, "big")
                router.send_multipart((client, b"", b"kv-events", seq.to_bytes(8, "big"), payload(1, seq)))
                router.send_multipart((client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""))

    thread = threading.Thread(target=answer_late, daemon=True)
    thread.start()
    publisher = LocalPublisher(replay=False)
    slow = EventEndpoint(publisher.endpoint, f"tcp://127.0.0.1:{replay_port}", "kv-events", 0, ORIGIN)
    follower = Follower([slow], catch_up=False)
    try:
        follower.connected(publisher)
        for seq in range(9):
            publisher.publish(payload(1, seq), live=seq % 3 == 0)
        assert wait_for(lambda: follower.seqs()[-1:] == [6], timeout=30)
        time.sleep(2)  # the late answers arrive at closed sockets
    finally:
        follower.stop()
        publisher.close()
        done.set()
        thread.join(5)
        router.close(linger=0)
        context.term()
    lines = [p.message for p in follower.problems]
    assert len(lines) == 1 and "did not answer in 1.0 s" in lines[0], lines
    assert follower.seqs() == [0, 3, 6] and follower.cache.stats(ORIGIN).lost == 4

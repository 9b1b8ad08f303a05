"""A KV event publisher of kvtui's own that speaks vLLM's protocol (PUB `(topic, seq, payload)`, a ROUTER replay
socket answering `(b"", start seq)` with the buffered batches and an end marker of seq -1): it replays recorded
payloads at a chosen rate. For the load benchmark (a busy server publishes far more than a CPU server here can
make), the tests of gaps, replay and bad payloads, and trying `kvtui attach --events` with no server."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable

import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _bind(socket: zmq.Socket, port: int | None) -> int:
    if port is None:
        return socket.bind_to_random_port("tcp://127.0.0.1")
    socket.bind(f"tcp://127.0.0.1:{port}")
    return port


class LocalPublisher:
    """Binds `tcp://127.0.0.1:PORT` (and a replay socket) and publishes payloads on a thread of its own. `port` and
    `replay_port` bind given ports (a restarted publisher comes back where it was); random ports by default.
    An XPUB socket (a PUB that hears subscriptions): `wait_subscribed` waits until a subscriber's subscription
    arrived, so a test's first batch is not dropped by ZeroMQ's slow joiner."""

    def __init__(
        self,
        topic: str = "kv-events",
        replay: bool = True,
        buffer: int = 10_000,
        hwm: int = 100_000,
        port: int | None = None,
        replay_port: int | None = None,
    ):
        self.topic = topic.encode()
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not only the first
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.port = _bind(self._pub, port)
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self._router = None
        self.replay_endpoint: str | None = None
        self.replay_port: int | None = None
        if replay:
            self._router = self._context.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self.replay_port = _bind(self._router, replay_port)
            self.replay_endpoint = f"tcp://127.0.0.1:{self.replay_port}"
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self._lock = threading.Lock()  # zmq sockets are not thread-safe: one thread sends at a time
        self.seq = 0
        self.sent = 0
        self.subscribed = 0  # subscriptions heard (a subscriber that reconnects subscribes again)
        self._stop = threading.Event()
        self._replayer = threading.Thread(target=self._serve_replay, name="kvtui-publisher-replay", daemon=True)
        self._replayer.start()

    def publish(self, payload: bytes, *, seq: int | None = None, live: bool = True) -> int:
        """Send one payload (`live=False`: keep it only for replay, as if the subscriber missed it)."""
        number = self.seq if seq is None else seq
        self.seq = number + 1
        with self._lock:
            self._buffer.append((number, payload))
            if live:
                self._pub.send_multipart((self.topic, number.to_bytes(8, "big"), payload))
                self.sent += 1
        return number

    def publish_at(self, payloads: Iterable[bytes], events_per_payload: int, rate: float, duration: float) -> int:
        """Cycle through `payloads` at `rate` events/s for `duration` seconds; the number of payloads sent."""
        items = list(payloads)
        start = time.perf_counter()
        sent = 0
        while not self._stop.is_set():
            elapsed = time.perf_counter() - start
            if elapsed >= duration:
                break
            due = int(elapsed * rate / events_per_payload) + 1
            while sent < due:
                self.publish(items[sent % len(items)])
                sent += 1
            time.sleep(0.0005)
        return sent

    def wait_subscribed(self, count: int = 1, timeout: float = 15.0) -> bool:
        """Wait until `count` subscriptions arrived in all (whether they did)."""
        deadline = time.monotonic() + timeout
        while self.subscribed < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.subscribed >= count

    def _serve_replay(self) -> None:
        poller = zmq.Poller()
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        while not self._stop.is_set():
            with self._lock:  # the PUB side is sent on from publish(): read it under the same lock
                while self._pub.poll(0):
                    if self._pub.recv()[:1] == b"\x01":  # a subscription (\x00: one ended)
                        self.subscribed += 1
            if self._router is None:
                time.sleep(0.02)
                continue
            if not poller.poll(20):
                continue
            client, _empty, start = self._router.recv_multipart()
            first = int.from_bytes(start, "big")
            with self._lock:
                batches = [(seq, payload) for seq, payload in self._buffer if seq >= first]
            for seq, payload in batches:
                self._router.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
            self._router.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self._stop.set()
        self._replayer.join(2)
        self._pub.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)
        self._context.term()

    def __enter__(self) -> LocalPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

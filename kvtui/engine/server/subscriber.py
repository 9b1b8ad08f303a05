"""Subscribe to KV event publishers (ZeroMQ SUB, one per server rank) and fold what they send into a PrefixCache.

Read-only: kvtui only subscribes, and asks a publisher's replay socket (ROUTER; kvtui's DEALER sends the first
sequence number wanted as 8 big-endian bytes) for what it missed. On attach it catches up through replay where
the server has one; a gap in the sequence numbers is asked for again, and what replay no longer holds is
counted as lost (PrefixCache.apply counts it from the numbers). A payload that does not decode is reported in
one line, skipped and counted. Every event is applied or counted: never silently lost.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from ..records.snapshot import Diagnostic
from .kv_events import EventBatch, UndecodablePayload, decode_message
from .prefix_cache import PrefixCache
from .server_http import EventEndpoint

REPLAY_WAIT_S = 1.0  # how long a replay answer may take before kvtui gives up on it (and counts the loss)
RECEIVE_HWM = 20_000  # messages the SUB socket queues while kvtui is busy: ZeroMQ drops past it, and the
# sequence numbers count what it dropped (lost), so memory stays bounded when a server outpaces the viewer
FREEZE_EVERY_S = 1.0
YIELD_S = 0.002  # ... then this long off the interpreter lock, so a saturated reader leaves the UI a share
BATCH_BUDGET_S = 0.005  # at most this long applying queued messages before the lock is let go for the UI


@dataclass
class Problem:
    """One line for the user: a payload that did not decode, a gap, a publisher that restarted."""

    origin: str
    message: str
    undecodable: bool = False  # a payload skipped (the trace counts these again on replay)


class Subscriber:
    """Subscribes to `endpoints` and applies their batches to `cache`, on the calling thread, until stopped.

    `on_batch(origin, batch, notes)` is called after each batch is applied (the trace writer);
    `on_problem(problem)` for each problem line."""

    def __init__(
        self,
        endpoints: list[EventEndpoint],
        cache: PrefixCache,
        on_batch: Callable[[str, EventBatch, list[Diagnostic]], None] | None = None,
        on_problem: Callable[[Problem], None] | None = None,
        catch_up: bool = True,
        yield_s: float = 0.0,
        freeze_gc: bool = True,
    ):
        self.endpoints = endpoints
        self.cache = cache
        self.on_batch = on_batch
        self.on_problem = on_problem
        self.catch_up = catch_up
        self.freeze_gc = freeze_gc  # kvtui's own process (attach): the garbage collector skips what it holds
        self.yield_s = yield_s  # a viewer beside it (the TUI): YIELD_S after each budget of applying
        self.undecodable = 0
        self.replayed = 0  # batches recovered through replay sockets
        self.stop = threading.Event()
        self._context = zmq.Context()
        self._sockets: dict[zmq.Socket, EventEndpoint] = {}
        self.connected = threading.Event()

    def _problem(self, origin: str, message: str, undecodable: bool = False) -> None:
        if self.on_problem is not None:
            self.on_problem(Problem(origin, message, undecodable))

    def run(self, duration: float | None = None) -> None:
        """Receive and apply until `stop` is set (or `duration` seconds passed)."""
        poller = zmq.Poller()
        try:
            for endpoint in self.endpoints:
                sub = self._context.socket(zmq.SUB)
                sub.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.SUBSCRIBE, endpoint.topic.encode())
                sub.connect(endpoint.endpoint)
                self._sockets[sub] = endpoint
                poller.register(sub, zmq.POLLIN)
            self.connected.set()
            if self.catch_up:
                for endpoint in self.endpoints:
                    if endpoint.replay:
                        with self.cache.lock:
                            self._replay(endpoint, 0, None)
            end = None if duration is None else time.monotonic() + duration
            frozen_at = time.monotonic()
            while not self.stop.is_set() and (end is None or time.monotonic() < end):
                if self.freeze_gc and time.monotonic() - frozen_at > FREEZE_EVERY_S:
                    # the blocks kept are many long-lived objects: a full collection walking them all stalled the
                    # screen for up to 360 ms at 20,000 events/s; frozen, collections walk only what is new. Blocks
                    # hold no reference cycles once dropped (their links are cut), so refcounting still frees them.
                    gc.freeze()
                    frozen_at = time.monotonic()
                ready = dict(poller.poll(100))
                busy = False
                for sub in ready:
                    busy |= self._drain(sub)
                if busy and self.yield_s:  # more is queued: the UI thread gets the interpreter a moment
                    time.sleep(self.yield_s)
        finally:
            for sub in self._sockets:
                sub.close(linger=0)
            self._context.term()

    def _drain(self, sub: zmq.Socket) -> bool:
        """Apply what is queued, for at most BATCH_BUDGET_S; whether more may be waiting."""
        endpoint = self._sockets[sub]
        until = time.monotonic() + BATCH_BUDGET_S
        with self.cache.lock:
            while time.monotonic() < until:
                try:
                    frames = sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    return False
                self._receive(endpoint, frames, live=True)
        return True

    def _receive(self, endpoint: EventEndpoint, frames: list[bytes], live: bool) -> None:
        origin = endpoint.origin
        try:
            batch = decode_message(frames)
        except UndecodablePayload as error:
            self.undecodable += 1
            self.cache.stats(origin).skipped += 1
            self._problem(origin, f"a message from {origin} did not decode ({error}); skipped", undecodable=True)
            return
        stats = self.cache.stats(origin)
        if stats.last_seq >= 0 and batch.seq <= stats.last_seq:
            if batch.seq == 0 and stats.last_seq > 0 and live:
                self._problem(origin, f"{origin}'s publisher restarted (sequence back to 0); its cache is read anew")
                stats.last_seq = -1
            else:
                return  # already applied (replay and live overlap)
        if live and stats.last_seq >= 0 and batch.seq > stats.last_seq + 1 and endpoint.replay:
            self._replay(endpoint, stats.last_seq + 1, batch.seq)  # fills what it can; apply counts the rest
        notes = self.cache.apply(batch, origin)
        if self.on_batch is not None:
            self.on_batch(origin, batch, notes)

    def _replay(self, endpoint: EventEndpoint, start: int, stop: int | None) -> None:
        """Ask the replay socket for batches from `start` (up to `stop`, exclusive) and apply them in order."""
        assert endpoint.replay is not None
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(endpoint.replay)
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while dealer.poll(int(REPLAY_WAIT_S * 1000)):
                frames = dealer.recv_multipart()
                frames = frames[1:] if frames and frames[0] == b"" else frames
                if len(frames) < 2 or int.from_bytes(frames[-2], "big", signed=True) < 0:
                    return  # the end marker
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if stop is not None and seq >= stop:
                    continue
                self.replayed += 1
                self._receive(endpoint, frames, live=False)
            self._problem(endpoint.origin, f"{endpoint.origin}'s replay socket did not answer in {REPLAY_WAIT_S} s")
        finally:
            dealer.close(linger=0)

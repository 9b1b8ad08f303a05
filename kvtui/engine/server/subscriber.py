"""Subscribe to KV event publishers (ZeroMQ SUB, one per server rank) and fold what they send into a PrefixCache.

Read-only: kvtui only subscribes, and asks a publisher's replay socket (ROUTER; kvtui's DEALER sends the first
sequence number wanted as 8 big-endian bytes) for what it missed. On attach it catches up through replay where
the server has one; a gap in the sequence numbers is asked for again, and what replay no longer holds is
counted as lost (PrefixCache.apply counts it from the numbers). Batches dropped at the end of a burst show no gap
until the next one: a publisher quiet for TAIL_CHECK_S is asked once for what followed the last batch applied. A
payload that does not decode is reported in one line, skipped and counted. Every event is applied or counted:
never silently lost.

Publishers restart (a crash, a process manager, a rolling deploy): each origin's batches belong to an epoch, one
per publisher process. A new epoch begins when
- a live batch's sequence number is not above the last one applied and it is not a copy of a batch replay gave
  (replay and live overlap on attach: those copies are dropped, within the epoch);
- the connection to the publisher was lost, and when it is back (or its next batch comes) its replay socket no
  longer holds the last batch applied as it was (another payload under that number, or nothing from it on);
- the server's HTTP side says it is another process (its start time in /metrics changed: `server_identity`) and no
  new epoch began since.
The old epoch's blocks are gone with it (PrefixCache.restart), the new epoch is followed from its first batch
(replay gives what the subscription missed: ZeroMQ's slow joiner), and one line says so. A lost connection and
its return are reported through `on_link` (the session says them once, not per batch).
"""

from __future__ import annotations

import gc
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from ..records.snapshot import Diagnostic
from .kv_events import EventBatch, UndecodablePayload, decode_message
from .prefix_cache import PrefixCache
from .server_http import EventEndpoint

TAIL_CHECK_S = 0.5  # an origin quiet this long after a live batch: its replay socket is asked what followed it
REPLAY_WAIT_S = 1.0  # how long a replay answer may take before kvtui gives up on it (and counts the loss)
RECEIVE_HWM = 20_000  # messages the SUB socket queues while kvtui is busy: ZeroMQ drops past it, and the
# sequence numbers count what it dropped (lost), so memory stays bounded when a server outpaces the viewer
COLLECT_EVERY_S = 300.0  # a full garbage collection this often: what is frozen between is freed by refcounts only,
# and cyclic garbage waits for this (none was found after 60,000 events of a fleet). It walks every block: about 1 s
# over 200,000 (load 7), while the queues hold what comes meanwhile
YIELD_S = 0.002  # ... then this long off the interpreter lock, so a saturated reader leaves the UI a share
BATCH_BUDGET_S = 0.005  # at most this long applying queued messages before the lock is let go for the UI
KNOWN_EVENTS = {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
LINK_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
_RCVMORE = int(zmq.RCVMORE)


@dataclass
class Problem:
    """One line for the user: a payload that did not decode, a gap, a publisher that restarted."""

    origin: str
    message: str
    undecodable: bool = False  # a payload skipped (the trace counts these again on replay)
    restart: bool = False  # the origin's publisher restarted: its blocks are gone (the trace replays that too)


@dataclass
class _Epoch:
    """What the subscriber knows of one origin's current epoch (besides its OriginStats)."""

    last_digest: int | None = None  # the payload of the last batch applied (to recognise it in a replay)
    replayed: dict[int, int] = field(default_factory=dict)  # seq -> payload digest, of batches replay gave that
    # live may bring again (the overlap on attach); emptied once live has passed them
    replayed_top: int = -1
    check: str | None = None  # the connection was lost: why the next look must tell if it is the same publisher
    connected: bool = False
    ever_connected: bool = False
    identity: object = None  # the server's process identity as its HTTP side last said it
    identity_restarts: int = 0  # the origin's restarts when that identity was read
    replay_silent: bool = False  # its replay socket did not answer (said once until it answers again)
    unknown_types: set[str] = field(default_factory=set)  # event types said once
    live_at: float = 0.0  # when its last live batch came (monotonic)
    tail_checked: bool = True  # replay was asked what followed its last live batch


def _digest(frames: list[bytes]) -> int:
    return hash(frames[-1])


class Subscriber:
    """Subscribes to `endpoints` and applies their batches to `cache`, on the calling thread, until stopped.

    `on_batch(origin, batch, notes)` is called after each batch is applied (the trace writer);
    `on_problem(problem)` for each problem line; `on_link(origin, up, detail)` when the connection to a
    publisher is lost (up False) or back (True)."""

    def __init__(
        self,
        endpoints: list[EventEndpoint],
        cache: PrefixCache,
        on_batch: Callable[[str, EventBatch, list[Diagnostic]], None] | None = None,
        on_problem: Callable[[Problem], None] | None = None,
        catch_up: bool = True,
        yield_s: float = 0.0,
        freeze_gc: bool = True,
        on_link: Callable[[str, bool, str], None] | None = None,
    ):
        self.endpoints = endpoints
        self.cache = cache
        self.on_batch = on_batch
        self.on_problem = on_problem
        self.on_link = on_link
        self.catch_up = catch_up
        self.freeze_gc = freeze_gc  # kvtui's own process (attach): the garbage collector skips what it holds
        self.yield_s = yield_s  # a viewer beside it (the TUI): YIELD_S after each budget of applying
        self.undecodable = 0
        self.replayed = 0  # batches recovered through replay sockets
        self.duplicates = 0  # live copies of batches replay gave (dropped: applied once)
        self.stop = threading.Event()
        self._context = zmq.Context()
        self._sockets: dict[zmq.Socket, EventEndpoint] = {}
        self._monitors: dict[zmq.Socket, EventEndpoint] = {}
        self._epochs: dict[str, _Epoch] = {}
        self._catching_up = False  # the replay on attach is being applied
        self._requests: deque[tuple[tuple[str, ...], object]] = deque()  # (origins, identity) from other threads
        self.connected = threading.Event()
        # set once what the replay socket held at attach time is applied: events after it are seen live (the front
        # ends say "attached" from then on, so a request sent next is never taken for one made before kvtui came)
        self.caught_up = threading.Event()
        self.viewer_waits = threading.Event()  # a frame is being read (reader_process.py): yield as for a viewer

    def _problem(self, origin: str, message: str, undecodable: bool = False, restart: bool = False) -> None:
        if self.on_problem is not None:
            self.on_problem(Problem(origin, message, undecodable, restart))

    def _epoch(self, origin: str) -> _Epoch:
        found = self._epochs.get(origin)
        if found is None:
            found = self._epochs[origin] = _Epoch()
        return found

    def server_identity(self, origins: list[str], identity: object) -> None:
        """The server's HTTP side names its process (its start time): a change means a new process, so a new epoch
        for its origins where none began since the last reading. Any thread; applied on the reader's."""
        self._requests.append((tuple(origins), identity))

    def run(self, duration: float | None = None) -> None:
        """Receive and apply until `stop` is set (or `duration` seconds passed)."""
        poller = zmq.Poller()
        try:
            for endpoint in self.endpoints:
                sub = self._context.socket(zmq.SUB)
                sub.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.SUBSCRIBE, endpoint.topic.encode())
                monitor = sub.get_monitor_socket(LINK_EVENTS)  # before connecting: the first handshake is seen
                sub.connect(endpoint.endpoint)
                self._sockets[sub] = endpoint
                self._monitors[monitor] = endpoint
                poller.register(monitor, zmq.POLLIN)
                poller.register(sub, zmq.POLLIN)
            self.connected.set()
            if self.catch_up:
                for endpoint in self.endpoints:
                    if endpoint.replay:
                        with self.cache.lock:
                            self._catching_up = True  # what it gives happened before kvtui attached
                            try:
                                self._replay(endpoint, 0, None)
                            finally:
                                self._catching_up = False
            self.caught_up.set()
            end = None if duration is None else time.monotonic() + duration
            collected_at = time.monotonic()
            while not self.stop.is_set() and (end is None or time.monotonic() < end):
                if self.freeze_gc and time.monotonic() - collected_at > COLLECT_EVERY_S:
                    gc.unfreeze()  # cyclic garbage frozen since the last one (none is made per event: see below)
                    gc.collect()
                    gc.freeze()
                    collected_at = time.monotonic()
                ready = dict(poller.poll(100))
                for monitor in self._monitors:  # a lost connection is known before what comes after it
                    if monitor in ready:
                        self._link(monitor)
                if self._requests:
                    self._identities()
                busy = False
                for sub in self._sockets:
                    if sub in ready:
                        busy |= self._drain(sub)
                if not busy:
                    self._check_tails()
                if self.freeze_gc:
                    # what was applied is long-lived (blocks, index entries): frozen after every drain (O(1)), the
                    # collector's passes walk only what the next drain makes. Frozen once a second, its passes walked
                    # up to a second of blocks: 14-25 µs per event, a fifth of the reader's time (RESULTS.md, 10).
                    # Blocks hold no reference cycles once dropped (their links are cut): refcounting frees them.
                    gc.freeze()
                if busy and (self.yield_s or self.viewer_waits.is_set()):  # more is queued: the thread that
                    time.sleep(self.yield_s or YIELD_S)  # reads frames gets the lock and the interpreter a moment
        finally:
            self.caught_up.set()  # (a reader that failed: no one waits on it)
            for sub in self._sockets:
                sub.disable_monitor()
                sub.close(linger=0)
            for monitor in self._monitors:
                monitor.close(linger=0)
            self._context.term()

    def _link(self, monitor: zmq.Socket) -> None:
        """The publisher's connection went or came back (ZeroMQ reconnects by itself)."""
        endpoint = self._monitors[monitor]
        state = self._epoch(endpoint.origin)
        while monitor.poll(0):
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED and state.connected:
                state.connected = False
                state.check = "the connection to it was lost"
                if self.on_link is not None:
                    self.on_link(
                        endpoint.origin, False, f"its event publisher {endpoint.endpoint} closed the connection"
                    )
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and not state.connected:
                state.connected = True
                again = state.ever_connected
                state.ever_connected = True
                if again:
                    if self.on_link is not None:
                        self.on_link(endpoint.origin, True, f"its event publisher {endpoint.endpoint} is back")
                    with self.cache.lock:
                        self._verify(endpoint, None)

    def _identities(self) -> None:
        by_origin = {e.origin: e for e in self.endpoints}
        while self._requests:
            origins, identity = self._requests.popleft()
            with self.cache.lock:
                for origin in origins:
                    endpoint = by_origin.get(origin)
                    if endpoint is None:
                        continue
                    state = self._epoch(origin)
                    stats = self.cache.stats(origin)
                    if state.identity is not None and identity != state.identity:
                        if stats.restarts == state.identity_restarts:  # no new epoch since the last reading
                            self._verify(endpoint, None, why_restarted="the server's start time changed")
                    state.identity, state.identity_restarts = identity, stats.restarts

    def _drain(self, sub: zmq.Socket) -> bool:
        """Apply what is queued, for at most BATCH_BUDGET_S; whether more may be waiting."""
        endpoint = self._sockets[sub]
        until = time.monotonic() + BATCH_BUDGET_S
        # recv_multipart written out with the option as an int (its getsockopt(RCVMORE) converts the enum per frame)
        recv, more, noblock = sub.recv, sub.get, int(zmq.NOBLOCK)
        with self.cache.lock:
            while time.monotonic() < until:
                try:
                    frames = [recv(noblock)]
                except zmq.Again:
                    return False
                while more(_RCVMORE):  # the rest of a multipart message has come with its first frame
                    frames.append(recv(noblock))
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
        state = self._epoch(origin)
        stats = self.cache.stats(origin)
        digest = _digest(frames)
        last = stats.last_seq
        if last >= 0 and batch.seq <= last:
            if (
                not live
                or state.replayed.get(batch.seq) == digest
                or (batch.seq == last and digest == state.last_digest)
            ):
                if live:
                    self.duplicates += 1
                return  # already applied (replay and live overlap)
            self._new_epoch(endpoint, f"its sequence went back from {last} to {batch.seq}")
        elif live and state.check is not None and last >= 0:
            self._verify(endpoint, batch.seq)  # the first batch after a lost connection: the same publisher?
        # where the numbers start over (a new epoch), the epoch's first batches are expected from 0
        expect = stats.last_seq + 1 if stats.last_seq >= 0 or stats.restarts else None
        if live and expect is not None and batch.seq > expect and endpoint.replay:
            self._replay(endpoint, expect, batch.seq)  # fills what it can; apply counts the rest
        if batch.skipped:
            self._unknown(endpoint, frames[-1])
        if not live and self._catching_up:
            batch = replace(batch, caught_up=True)
        notes = self.cache.apply(batch, origin)
        if stats.last_seq == batch.seq:
            state.last_digest = digest
        if live:
            state.live_at, state.tail_checked = time.monotonic(), False
            if state.replayed and batch.seq > state.replayed_top:
                state.replayed.clear()  # live has passed what replay gave: no more copies can come
        else:
            state.replayed[batch.seq] = digest
            state.replayed_top = max(state.replayed_top, batch.seq)
        if self.on_batch is not None:
            self.on_batch(origin, batch, notes)

    def _check_tails(self) -> None:
        """Batches ZeroMQ dropped at the end of a burst (past RECEIVE_HWM) leave no gap until the next batch comes,
        which an idle server never sends: once an origin is quiet for TAIL_CHECK_S after a live batch, its replay
        socket is asked, once, for anything after the last batch applied, and that is applied (counted replayed).
        O(origins) per idle poll; the question is asked off the cache's lock."""
        now = time.monotonic()
        for endpoint in self.endpoints:
            state = self._epoch(endpoint.origin)
            if state.tail_checked or now - state.live_at < TAIL_CHECK_S:
                continue
            state.tail_checked = True
            last = self.cache.stats(endpoint.origin).last_seq
            if not endpoint.replay or not state.connected or state.check is not None or last < 0:
                continue  # nothing to ask, or the link's own check decides (its return)
            answer = self._ask(endpoint, last + 1, quiet=True)
            if answer:
                with self.cache.lock:
                    self._apply_replayed(endpoint, answer, None)

    def _new_epoch(self, endpoint: EventEndpoint, why: str) -> None:
        """The origin's publisher is a new one: the old one's blocks are gone, its sequence followed anew."""
        origin = endpoint.origin
        gone = self.cache.restart(origin)
        state = self._epoch(origin)
        state.last_digest, state.check, state.replayed_top = None, None, -1
        state.replayed.clear()
        self._problem(
            origin,
            f"{origin}'s publisher restarted ({why}): blocks gone with the old process {gone}, no longer held; "
            "following the new one from its first batch",
            restart=True,
        )

    def _verify(self, endpoint: EventEndpoint, upto: int | None, why_restarted: str | None = None) -> None:
        """Is the publisher the one kvtui followed? Asks its replay socket for the last batch applied: the same
        payload there is the same process (what follows fills the gap); another payload, or nothing from that
        number on, is a new one. `upto`: the live batch that prompted it (replay stops before it). Where the replay
        socket cannot tell, `why_restarted` (the server's HTTP side) decides, else the next batch's number does."""
        state = self._epoch(endpoint.origin)
        stats = self.cache.stats(endpoint.origin)
        last = stats.last_seq
        if last < 0:
            state.check = None
            if why_restarted is not None and stats.batches:
                self._new_epoch(endpoint, why_restarted)
            return
        answer = self._ask(endpoint, last, quiet=True) if endpoint.replay else None  # no answer: decided later
        if answer is None:  # no replay socket, or it did not answer
            if why_restarted is not None:
                self._new_epoch(endpoint, why_restarted)
            elif upto is not None:  # the batch after a lost connection, and nothing to tell by: its number decides
                state.check = None
                if upto > last + 1:
                    self._problem(
                        endpoint.origin,
                        f"{endpoint.origin}'s publisher was away and nothing can say whether it restarted (no replay "
                        f"answer): its batches are taken as the same process's ({upto - last - 1} missed, counted "
                        "lost)",
                    )
            return
        state.check = None
        if answer and answer[0][0] == last:
            if _digest(answer[0][1]) == state.last_digest:  # the same process: what it sent meanwhile fills the gap
                self._apply_replayed(endpoint, answer[1:], upto)
                return
            why = why_restarted or f"its replay socket holds another batch {last}"
        elif not answer:
            why = why_restarted or f"its replay socket holds nothing from batch {last} on"
        elif why_restarted is None:  # it no longer holds batch `last` (past its buffer): the same, with a gap
            self._apply_replayed(endpoint, answer, upto)
            return
        else:
            why = why_restarted
        self._new_epoch(endpoint, why)
        if upto is None:
            self._replay(endpoint, 0, None)  # what the new one sent before kvtui saw it

    def _unknown(self, endpoint: EventEndpoint, payload: bytes) -> None:
        """Events of a type kvtui does not know are counted (skipped); each type is named once per origin."""
        state = self._epoch(endpoint.origin)
        names: set[str] = set()
        try:
            raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
            events = raw.get("events") if isinstance(raw, dict) else raw[1]
            for event in events or ():
                kind = event.get("type") if isinstance(event, dict) else event[0] if event else None
                names.add(kind.decode("utf-8", "replace") if isinstance(kind, bytes) else str(kind))
        except Exception:  # noqa: BLE001  (it decoded once: this only names what was skipped)
            names.add("?")
        fresh = sorted(names - KNOWN_EVENTS - state.unknown_types)
        if fresh:
            state.unknown_types.update(fresh)
            self._problem(
                endpoint.origin,
                f"{endpoint.origin} sent events of a type kvtui does not know ({', '.join(fresh)}): each is counted "
                "as skipped, the rest of their batches applied",
            )

    def _ask(self, endpoint: EventEndpoint, start: int, quiet: bool = False) -> list[tuple[int, list[bytes]]] | None:
        """The replay socket's batches from `start` in order (empty: it holds none), or None where it did not
        answer in REPLAY_WAIT_S (said once, until it answers again, unless `quiet`: a publisher starting up may
        be too busy to answer a check); what came before a stall is kept."""
        assert endpoint.replay is not None
        state = self._epoch(endpoint.origin)
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, list[bytes]]] = []
        try:
            dealer.connect(endpoint.replay)
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while dealer.poll(int(REPLAY_WAIT_S * 1000)):
                frames = dealer.recv_multipart()
                frames = frames[1:] if frames and frames[0] == b"" else frames
                seq = int.from_bytes(frames[-2], "big", signed=True) if len(frames) >= 2 else -1
                if seq < 0:  # the end marker
                    state.replay_silent = False
                    return out
                out.append((seq, frames))
        finally:
            dealer.close(linger=0)
        if not state.replay_silent and not quiet:
            state.replay_silent = True
            got = f" after {len(out)} batches" if out else ""
            self._problem(
                endpoint.origin,
                f"{endpoint.origin}'s replay socket {endpoint.replay} did not answer in {REPLAY_WAIT_S} s{got}: "
                "batches only it could give are counted lost (said once, until it answers)",
            )
        return out or None

    def _replay(self, endpoint: EventEndpoint, start: int, stop: int | None) -> None:
        """Ask the replay socket for batches from `start` (up to `stop`, exclusive) and apply them in order."""
        self._apply_replayed(endpoint, self._ask(endpoint, start) or (), stop)

    def _apply_replayed(self, endpoint: EventEndpoint, answer, stop: int | None) -> None:
        """Apply what a replay socket gave (`(seq, frames)` in order), up to `stop` (exclusive; None: all)."""
        for seq, frames in answer:
            if stop is None or seq < stop:
                self.replayed += 1
                self._receive(endpoint, frames, live=False)

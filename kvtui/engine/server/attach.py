"""`kvtui attach`: one object that reads one or several servers' prefix caches, whichever front end shows it.

It finds the publishers (`/kv_event_sources`, or `--events`), subscribes on a thread of its own (Subscriber),
polls each server's /metrics once a second on another (the hit rate over time, the capacity), and writes the
trace when asked: the same records whether the TUI or the headless runner drove it. It only reads: it
subscribes to the publishers and GETs metrics, so the servers answer exactly as unattached.

Servers go away and come back. While one cannot be reached (its /metrics does not answer, or an event publisher
closed the connection) one line says since when, and `outages` holds it for the screen; when every part of it
answers again, one line says so. ZeroMQ reconnects by itself and the poller keeps asking, so events and metrics
resume with no action; the subscriber tells a restarted server from the same one (its epochs).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..reading.token_texts import TokenTexts
from ..records.snapshot import Diagnostic
from . import server_http
from .kv_events import EventBatch
from .prefix_cache import MAX_BLOCKS, PrefixCache
from .server_http import (
    EventEndpoint,
    ServerError,
    ServerInfo,
    TextSource,
    discover,
    fetch_metrics,
    given_endpoints,
    normalize_url,
    origin_name,
)
from .server_trace import ServerTraceWriter
from .subscriber import Problem, Subscriber

METRICS_EVERY_S = 1.0
CATCH_UP_WAIT_S = (
    30.0  # start() waits this long at most for the catch-up through the replay socket (it goes on past it)
)


@dataclass
class Outage:
    """A server (or one data-parallel rank of it) that cannot be reached."""

    name: str  # what the lines name
    since: float  # time.time() of the first failure
    down: set[str] = field(default_factory=set)  # what failed: "http" (its /metrics), or an origin (its publisher)

    @property
    def since_text(self) -> str:
        return clock(self.since)


def clock(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))


@dataclass
class AttachOptions:
    urls: list[str] = field(default_factory=list)
    events: str | None = None  # tcp://HOST:PORT instead of asking the server
    replay: str | None = None  # the replay endpoint with --events
    dp_ranks: int = 1
    topic: str = ""
    tokenizer: str | None = None
    trace: Path | None = None
    max_blocks: int = MAX_BLOCKS
    metrics: bool = True


def connect(options: AttachOptions) -> list[ServerInfo]:
    """The servers and their publishers (raises ServerError saying why and what to do)."""
    if not options.urls and not options.events:
        raise ServerError("name a server URL (kvtui attach http://HOST:PORT) or a publisher (--events tcp://HOST:PORT)")
    if options.events:
        url = normalize_url(options.urls[0]) if options.urls else ""
        info = ServerInfo(url=url)
        if url:
            try:
                info = discover(url)
            except ServerError:
                info = ServerInfo(url=url)  # the events are given: the server's HTTP side is optional
        info.endpoints = given_endpoints(options.events, options.dp_ranks, options.topic, options.replay)
        return [info]
    return [discover(url) for url in options.urls]


def title_of(servers: list[ServerInfo], endpoints: list[EventEndpoint]) -> str:
    names = ", ".join(f"{s.model} at {s.url}" if s.url else s.model for s in servers)
    return names or ", ".join(e.endpoint for e in endpoints)


class AttachSession:
    """Reads servers' prefix caches into one PrefixCache, on threads of its own, until stopped."""

    def __init__(self, options: AttachOptions, servers: list[ServerInfo]):
        self.options = options
        self.servers = servers
        self.endpoints: list[EventEndpoint] = [e for s in servers for e in s.endpoints]
        first = servers[0] if servers else ServerInfo("")
        local = options.tokenizer or (first.root if first.root and Path(first.root).exists() else None)
        self.text_source = TextSource(first.url or None, first.model, local)
        self.text_source.on_state = self._texts
        # no tokenizer and no URL: nothing to ask (it would answer {} for every id of every event)
        resolve = self.text_source if self.text_source.where != "none" else None
        self.cache = PrefixCache(TokenTexts(resolve, self.text_source.special), options.max_blocks)
        self.problems: deque[Problem] = deque(maxlen=200)
        self.on_note: list[Callable[[Diagnostic], None]] = []
        self.on_problem: list[Callable[[Problem], None]] = []
        self.writer = ServerTraceWriter(options.trace, servers, self.cache) if options.trace else None
        self.subscriber = Subscriber(self.endpoints, self.cache, self._batch, self._problem, on_link=self._publisher)
        self.outages: dict[int, Outage] = {}  # per server (its index): while it cannot be reached
        self._server_of = {e.origin: index for index, s in enumerate(servers) for e in s.endpoints}
        self._outage_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.error: BaseException | None = None

    @property
    def title(self) -> str:
        return title_of(self.servers, self.endpoints)

    def _batch(self, origin: str, batch: EventBatch, notes: list[Diagnostic]) -> None:
        if self.writer is not None:
            self.writer.batch(origin, batch, notes)
        for note in notes:
            for listener in self.on_note:
                listener(note)

    def _problem(self, problem: Problem) -> None:
        self.problems.append(problem)
        if self.writer is not None:
            self.writer.problem(
                problem.origin, problem.message, undecodable=problem.undecodable, restart=problem.restart
            )
        for listener in self.on_problem:
            listener(problem)

    def _name(self, index: int) -> str:
        if not self.servers:
            return ""
        server = self.servers[index]
        if server.url:
            return origin_name(server.url)
        return server.endpoints[0].origin if server.endpoints else ""

    def _publisher(self, origin: str, up: bool, detail: str) -> None:
        self._reach(self._server_of.get(origin, 0), origin, up, detail)

    def _reach(self, index: int, channel: str, up: bool, detail: str) -> None:
        """One part of a server failed (up False) or answered (True): one line when the server becomes unreachable,
        one when all of it answers again; nothing in between."""
        now = time.time()
        line = None
        with self._outage_lock:
            outage = self.outages.get(index)
            if not up and outage is None:
                server = self._name(index)
                name = channel if channel not in ("http", server) else server  # a rank alone: its own name
                self.outages[index] = Outage(name, now, {channel})
                line = (
                    f"{name} unreachable since {clock(now)} ({detail}); kvtui keeps what it holds and reconnects by "
                    "itself"
                )
            elif not up and outage is not None:
                outage.down.add(channel)
            elif outage is not None and channel in outage.down:
                outage.down.discard(channel)
                if not outage.down:
                    del self.outages[index]
                    line = (
                        f"{outage.name} answers again at {clock(now)} (unreachable for {now - outage.since:.0f} s); "
                        "events and metrics resume"
                    )
        if line is not None:
            self._problem(Problem(channel if channel != "http" else self._name(index), line))

    def _texts(self, answers: bool, error: ServerError) -> None:
        """/detokenize failed (`answers` False) or answers again: an unreachable server is the outage's line."""
        if error.unreachable:
            self._reach(0, "http", answers, f"/detokenize: {error}")
        elif answers:
            self._problem(Problem(self._name(0), "token texts: /detokenize answers again"))
        else:
            self._problem(
                Problem(
                    self._name(0),
                    f"token texts: {error}; tokens are shown by number until /detokenize answers (asked again every "
                    f"{server_http.DETOKENIZE_RETRY_S:.0f} s)",
                )
            )

    def unreachable(self) -> list[Outage]:
        """The servers that cannot be reached now (for the screen)."""
        with self._outage_lock:
            return list(self.outages.values())

    def start(self, duration: float | None = None) -> None:
        reader = threading.Thread(target=self._read, args=(duration,), name="kvtui-kv-events", daemon=True)
        self._threads.append(reader)
        reader.start()
        if self.options.metrics and any(s.url for s in self.servers):
            poller = threading.Thread(target=self._poll_metrics, name="kvtui-metrics", daemon=True)
            self._threads.append(poller)
            poller.start()
        self.subscriber.connected.wait(5)
        self.subscriber.caught_up.wait(CATCH_UP_WAIT_S)

    def _read(self, duration: float | None) -> None:
        try:
            self.subscriber.run(duration)
        except BaseException as error:  # noqa: BLE001  shown by the front end; the viewer keeps what it has
            self.error = error
            self._problem(Problem("", f"the event reader stopped: {type(error).__name__}: {error}"))

    def _poll_metrics(self) -> None:
        failed: set[str] = set()  # servers that answer, but not with metrics (said once, and when they do again)
        while not self.subscriber.stop.wait(METRICS_EVERY_S):
            for index, server in enumerate(self.servers):
                if not server.url:
                    continue
                origin = origin_name(server.url)
                try:
                    metrics = fetch_metrics(server.url)
                except ServerError as error:
                    if error.unreachable:
                        self._reach(index, "http", False, f"metrics: {error}")
                    elif server.url not in failed:
                        failed.add(server.url)
                        self._problem(Problem(origin, f"metrics: {error} (the hit rate stops until it answers)"))
                    continue
                self._reach(index, "http", True, "")
                if server.url in failed:
                    failed.discard(server.url)
                    self._problem(Problem(origin, f"metrics: {origin}/metrics answers again"))
                if metrics.started is not None:  # the process serving now: a new one is a restart
                    self.subscriber.server_identity([e.origin for e in server.endpoints], metrics.started)
                ts = time.time()
                notes: list[Diagnostic] = []
                with self.cache.lock:  # written under it too: the trace keeps the order batches and polls came in
                    self.cache.record_metrics(origin, ts, metrics, notes)
                    if self.writer is not None:
                        self.writer.metrics(origin, ts, metrics, notes)
                for note in notes:
                    for listener in self.on_note:
                        listener(note)

    @property
    def running(self) -> bool:
        return bool(self._threads) and self._threads[0].is_alive()

    def wait(self, timeout: float | None = None) -> None:
        if self._threads:
            self._threads[0].join(timeout)

    def stop(self) -> None:
        self.subscriber.stop.set()
        for thread in self._threads:
            thread.join(5)
        if self.writer is not None:
            self.writer.close()

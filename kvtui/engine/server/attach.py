"""`kvtui attach`: one object that reads one or several servers' prefix caches, whichever front end shows it.

It finds the publishers (`/kv_event_sources`, or `--events`), subscribes on a thread of its own (Subscriber),
polls each server's /metrics once a second on another (the hit rate over time, the capacity), and writes the
trace when asked: the same records whether the TUI or the headless runner drove it. It only reads: it
subscribes to the publishers and GETs metrics, so the servers answer exactly as unattached.
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


class AttachSession:
    """Reads servers' prefix caches into one PrefixCache, on threads of its own, until stopped."""

    def __init__(self, options: AttachOptions, servers: list[ServerInfo]):
        self.options = options
        self.servers = servers
        self.endpoints: list[EventEndpoint] = [e for s in servers for e in s.endpoints]
        first = servers[0] if servers else ServerInfo("")
        local = options.tokenizer or (first.root if first.root and Path(first.root).exists() else None)
        self.text_source = TextSource(first.url or None, first.model, local)
        self.cache = PrefixCache(TokenTexts(self.text_source, self.text_source.special), options.max_blocks)
        self.problems: deque[Problem] = deque(maxlen=200)
        self.on_note: list[Callable[[Diagnostic], None]] = []
        self.on_problem: list[Callable[[Problem], None]] = []
        self.writer = ServerTraceWriter(options.trace, servers, self.cache) if options.trace else None
        self.subscriber = Subscriber(self.endpoints, self.cache, self._batch, self._problem)
        self._threads: list[threading.Thread] = []
        self.error: BaseException | None = None

    @property
    def title(self) -> str:
        names = ", ".join(f"{s.model} at {s.url}" if s.url else s.model for s in self.servers)
        return names or ", ".join(e.endpoint for e in self.endpoints)

    def _batch(self, origin: str, batch: EventBatch, notes: list[Diagnostic]) -> None:
        if self.writer is not None:
            self.writer.batch(origin, batch, notes)
        for note in notes:
            for listener in self.on_note:
                listener(note)

    def _problem(self, problem: Problem) -> None:
        self.problems.append(problem)
        if self.writer is not None:
            self.writer.problem(problem.origin, problem.message, undecodable=problem.undecodable)
        for listener in self.on_problem:
            listener(problem)

    def start(self, duration: float | None = None) -> None:
        reader = threading.Thread(target=self._read, args=(duration,), name="kvtui-kv-events", daemon=True)
        self._threads.append(reader)
        reader.start()
        if self.options.metrics and any(s.url for s in self.servers):
            poller = threading.Thread(target=self._poll_metrics, name="kvtui-metrics", daemon=True)
            self._threads.append(poller)
            poller.start()
        self.subscriber.connected.wait(5)

    def _read(self, duration: float | None) -> None:
        try:
            self.subscriber.run(duration)
        except BaseException as error:  # noqa: BLE001  shown by the front end; the viewer keeps what it has
            self.error = error
            self._problem(Problem("", f"the event reader stopped: {type(error).__name__}: {error}"))

    def _poll_metrics(self) -> None:
        failed: set[str] = set()
        while not self.subscriber.stop.wait(METRICS_EVERY_S):
            for server in self.servers:
                if not server.url:
                    continue
                origin = origin_name(server.url)
                try:
                    metrics = fetch_metrics(server.url)
                except ServerError as error:
                    if server.url not in failed:
                        failed.add(server.url)
                        self._problem(Problem(origin, f"metrics: {error} (the hit rate stops until it answers)"))
                    continue
                failed.discard(server.url)
                ts = time.time()
                with self.cache.lock:
                    self.cache.record_metrics(origin, ts, metrics)
                if self.writer is not None:
                    self.writer.metrics(origin, ts, metrics)

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

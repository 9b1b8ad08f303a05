"""A server's /metrics over time: each poll's prefix-cache counters and the hit rate since the poll before (a
prefix hit stores no block, so the events alone cannot tell it)."""

from __future__ import annotations

from collections import deque

from ..records.snapshot import frozen

METRICS_KEPT = 3600  # metric samples kept per server (an hour at one a second)


@frozen
class MetricSample:
    """One poll of a server's /metrics: its prefix-cache counters and the hit rate since the poll before."""

    ts: float
    queries: float | None
    hits: float | None
    rate: float | None  # hits / queries over the interval since the previous sample (None: no new queries)
    overall: float | None  # hits / queries since the server started
    capacity: int | None
    usage: float | None


def add_sample(samples: deque[MetricSample], ts: float, metrics) -> MetricSample:
    """Append one poll (server_http.CacheMetrics) to a server's samples; the sample, its rates worked out."""
    rate = None
    before = samples[-1] if samples else None
    if before is not None and None not in (metrics.queries, metrics.hits, before.queries, before.hits):
        asked = metrics.queries - before.queries
        rate = (metrics.hits - before.hits) / asked if asked > 0 else None
    overall = metrics.hits / metrics.queries if metrics.queries and metrics.hits is not None else None
    sample = MetricSample(ts, metrics.queries, metrics.hits, rate, overall, metrics.capacity, metrics.usage)
    samples.append(sample)
    return sample


def watched_rate(samples) -> tuple[float, float, float] | None:
    """The hit rate over the interval kvtui watched (first poll to last), with the hits and queries in it; None
    where no query came in it. A server's lifetime counters (`overall`) include what came before kvtui attached."""
    if len(samples) < 2:
        return None
    first, last = samples[0], samples[-1]
    if None in (first.queries, first.hits, last.queries, last.hits):
        return None
    asked = last.queries - first.queries
    if asked <= 0:
        return None
    hits = last.hits - first.hits
    return hits / asked, hits, asked

"""A fleet over time: per origin, the tokens prefilled there while another replica held them (routing waste, a
running total since kvtui attached) and the tokens held there that another replica holds too (memory spent more
than once, at that moment), sampled from the index (prefix_cache.PrefixCache) as events arrive.

A sample is taken after the first batch at least FLEET_EVERY_S seconds (by the events' own clock) after the one
before, so a replayed trace gives the same samples as the live run; idle time takes none. O(origins) per sample.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from ..records.snapshot import frozen

FLEET_EVERY_S = 1.0
FLEET_KEPT = 3600  # samples kept (an hour of busy traffic)


@frozen
class FleetSample:
    ts: float  # the event time of the batch it follows
    routed: tuple[tuple[str, int], ...]  # per origin, routing waste in tokens since kvtui attached (a running total)
    twice: tuple[tuple[str, int], ...]  # per origin, tokens held that another origin holds too, at `ts`


def fleet_sample(ts: float, routed: Mapping[str, int], twice: Mapping[str, int]) -> FleetSample:
    return FleetSample(ts, tuple(routed.items()), tuple((origin, twice.get(origin, 0)) for origin in routed))


class FleetSeries:
    """The samples, oldest first (the newest FLEET_KEPT)."""

    def __init__(self, kept: int = FLEET_KEPT):
        self.samples: deque[FleetSample] = deque(maxlen=kept)
        self._next: float | None = None

    def due(self, ts: float) -> bool:
        """Whether the batch at `ts` (just applied) takes a sample (one compare per batch)."""
        return self._next is None or ts >= self._next

    def add(self, ts: float, routed: Mapping[str, int], twice: Mapping[str, int]) -> None:
        self.samples.append(fleet_sample(ts, routed, twice))
        self._next = ts + FLEET_EVERY_S


def per_interval(values: list[int]) -> list[int]:
    """A running total's increase between consecutive samples (what was added in each interval)."""
    return [max(0, b - a) for a, b in zip(values, values[1:], strict=False)]

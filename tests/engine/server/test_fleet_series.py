"""The fleet over time (server/fleet.py, the plot's data): per origin, the routing waste (a running total) and the
tokens held twice at each sample equal an independent count made here from the raw events alone: which origin
holds which prompt prefix, and which stores came while another origin held the same tokens."""

from __future__ import annotations

import random

import pytest

from kvtui.engine.reading.token_texts import TokenTexts
from kvtui.engine.server.fleet import FLEET_EVERY_S
from kvtui.engine.server.kv_events import AllCleared, BlocksRemoved, BlocksStored, EventBatch
from kvtui.engine.server.prefix_cache import PrefixCache
from kvtui.engine.server.view import stats_view

pytestmark = pytest.mark.version_free("a server's events, HTTP and traces, read by kvtui alone: no transformers code")

SIZE = 8
ORIGINS = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")


def test_samples_equal_an_independent_count_from_the_raw_events():
    rng = random.Random(11)
    prompts = [tuple(rng.randrange(40) for _ in range(3 * SIZE)) for _ in range(5)]
    cache = PrefixCache(TokenTexts())
    held: dict[str, dict[str, tuple]] = {o: {} for o in ORIGINS}  # per origin: block key -> its prompt's prefix
    routed = dict.fromkeys(ORIGINS, 0)
    expected_samples = []
    next_sample = None
    for seq in range(600):
        origin = rng.choice(ORIGINS)
        ts = seq * 0.3
        mine = held[origin]
        roll = rng.random()
        if roll < 0.55:
            p = rng.randrange(len(prompts))
            keys = [f"{origin}/{p}/{i}" for i in range(3)]
            if any(k in mine for k in keys):
                continue  # (kept to whole prompts from their start: no store goes on from a block held)
            event: object = BlocksStored(tuple(keys), None, prompts[p], SIZE)
            for i, key in enumerate(keys):
                prefix = prompts[p][: SIZE * (i + 1)]
                if any(prefix in held[o].values() for o in ORIGINS if o != origin):
                    routed[origin] += SIZE  # prefilled here while another origin held these tokens
                mine[key] = prefix
        elif roll < 0.95 and mine:
            key = rng.choice(sorted(mine))
            event = BlocksRemoved((key,))
            del mine[key]
        elif roll < 0.97:
            event = AllCleared()
            mine.clear()
        else:
            continue
        cache.apply(EventBatch(seq, ts, (event,)), origin)  # type: ignore[arg-type]
        if next_sample is None or ts >= next_sample:
            twice = {}
            for o in ORIGINS:
                twice[o] = sum(
                    SIZE for prefix in held[o].values() if any(prefix in held[x].values() for x in ORIGINS if x != o)
                )
            expected_samples.append((ts, dict(routed), twice))
            next_sample = ts + FLEET_EVERY_S
    samples = list(cache.fleet.samples)
    assert len(samples) == len(expected_samples) > 50
    for sample, (ts, routed_then, twice_then) in zip(samples, expected_samples, strict=True):
        assert sample.ts == ts
        assert {o: v for o, v in sample.routed} == {o: routed_then[o] for o, _ in sample.routed}
        assert {o: v for o, v in sample.twice} == {o: twice_then[o] for o, _ in sample.twice}
    assert max(routed.values()) > 0 and any(v for _, _, t in expected_samples for v in t.values())

    # the plot's data: the samples, then the index now; the waste per interval sums to each origin's total
    view = stats_view(cache)
    assert view.fleet[:-1] == tuple(samples[-len(view.fleet) + 1 :])
    assert dict(view.fleet[-1].routed) == {o: routed[o] for o in dict(view.fleet[-1].routed)}
    from kvtui.widgets.server.fleet_plot import fleet_series

    for origin, waste, twice, total in fleet_series(view):
        assert total == routed[origin] and sum(waste) == routed[origin] - dict(view.fleet[0].routed)[origin]
        assert twice[-1] == cache.duplicated().get(origin, 0) and len(waste) == len(twice) - 1


def test_one_origin_draws_no_fleet_and_idle_time_takes_no_sample():
    cache = PrefixCache(TokenTexts())
    cache.apply(EventBatch(0, 10.0, (BlocksStored(("a",), None, tuple(range(8)), SIZE),)), "one")
    cache.apply(EventBatch(1, 10.5, (BlocksStored(("b",), None, tuple(range(9, 17)), SIZE),)), "one")
    cache.apply(EventBatch(2, 500.0, (BlocksRemoved(("a",)),)), "one")
    assert [s.ts for s in cache.fleet.samples] == [10.0, 500.0]
    assert stats_view(cache).fleet == ()

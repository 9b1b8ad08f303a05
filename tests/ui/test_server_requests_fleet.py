"""The server screen's requests pane (each prefill's hits and new tokens: reported where the client asked, else
inferred and marked so) and its fleet plot (per replica, routing waste and tokens held twice over time)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from kvtui import viewers
from kvtui.engine.reading.token_texts import TokenTexts
from kvtui.engine.server.kv_events import BlocksStored, EventBatch
from kvtui.engine.server.prefix_cache import PrefixCache
from kvtui.engine.server.server_trace import ServerRun
from kvtui.widgets.server.fleet_plot import FleetPlot
from kvtui.widgets.server.request_rows import INFERRED_TITLE, REPORTED_TITLE, RequestRows
from test_layout import screen_text

SIZE = 4
PROMPT = tuple(range(100, 116))  # 4 blocks
ONE, TWO = "10.0.0.1:8000", "10.0.0.2:8000"


def plain(renderable) -> str:
    console = Console(width=200, record=True, color_system=None, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(renderable)
    return console.export_text()


def stored(keys, tokens, parent=None, session=None) -> BlocksStored:
    return BlocksStored(tuple(keys), parent, tuple(tokens), SIZE, medium="GPU", session=session)


def app_of(cache: PrefixCache):
    return viewers.server(run=ServerRun(Path("synthetic.jsonl"), {"servers": []}, cache))


async def test_inferred_hits_are_marked_and_a_report_changes_the_title():
    cache = PrefixCache(TokenTexts())
    cache.apply(EventBatch(0, 10.0, (stored(["a0", "a1", "a2", "a3"], PROMPT),)), ONE)
    cache.apply(EventBatch(1, 11.0, (stored(["q0"], range(300, 304), parent="a2"),)), ONE)
    app = app_of(cache)
    async with app.run_test(size=(140, 40)) as pilot:
        await pilot.pause(0.2)
        pane = app.query_one(RequestRows)
        assert pane.border_title == INFERRED_TITLE
        lines = plain(pane.content).splitlines()
        assert "hit ~12 · new 4 · chain #1" in lines[0] and "hit ~0 · new 16" in lines[1]
        assert not app.query_one(FleetPlot).display  # one server: no fleet plot
    cache.apply(EventBatch(2, 12.0, (stored(["a0", "a1", "a2", "a3"], PROMPT, session="s-7"),)), ONE)
    app = app_of(cache)
    async with app.run_test(size=(140, 40)) as pilot:
        await pilot.pause(0.2)
        pane = app.query_one(RequestRows)
        assert pane.border_title == REPORTED_TITLE
        assert "hit 16 · new 0 · session s-7 · chain #1" in plain(pane.content).splitlines()[0]


async def test_the_fleet_plot_draws_each_replica_over_time_and_fits_80x24():
    cache = PrefixCache(TokenTexts())
    keys = [f"b{i}" for i in range(4)]
    cache.apply(EventBatch(0, 10.0, (stored(["a0", "a1", "a2", "a3"], PROMPT),)), ONE)
    cache.apply(EventBatch(0, 12.0, (stored(keys, PROMPT),)), TWO)  # routed to the replica without it: 16 wasted
    cache.apply(EventBatch(1, 14.0, (stored(["c0"], range(500, 504)),)), TWO)
    for size in ((140, 40), (80, 24)):
        app = app_of(cache)
        async with app.run_test(size=size) as pilot:
            await pilot.pause(0.2)
            plot = app.query_one(FleetPlot)
            assert plot.display
            assert [(o, w, t, total) for o, w, t, total in plot.shown] == [
                (ONE, [0, 0, 0], [0, 16, 16, 16], 0),
                (TWO, [16, 0, 0], [0, 16, 16, 16], 16),
            ]
            text = screen_text(app)
            if size == (140, 40):
                assert "waste 16" in text and "twice 16" in text, text

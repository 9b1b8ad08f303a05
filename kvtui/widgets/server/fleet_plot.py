"""The attach screen's fleet over time (shown where several servers or ranks are followed): per replica, the
tokens prefilled there while another replica held them (routing waste, per interval between samples) and the
tokens held there that another replica holds too (memory spent twice, at each sample), each a sparkline, with
its total now. The samples are the index's (engine/server/fleet.py), the last one the index as it is now."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Static

from ...engine.server.fleet import per_interval
from ...engine.server.view import StatsView
from ..shared.count_sparkline import CountSparkline

MAX_REPLICAS = 6  # rows drawn; more are counted on the last line


def fleet_series(view: StatsView) -> list[tuple[str, list[int], list[int], int]]:
    """Per origin (in the view's order): the routing waste added in each interval between the samples shown, the
    tokens held twice at each sample, and the routing waste in all (since kvtui attached). Empty where fewer than
    two origins are followed."""
    if len(view.origins) < 2 or not view.fleet:
        return []
    out = []
    for origin, _ in view.origins:
        routed = [dict(sample.routed).get(origin, 0) for sample in view.fleet]
        twice = [dict(sample.twice).get(origin, 0) for sample in view.fleet]
        out.append((origin, per_interval(routed), twice, routed[-1]))
    return out


class FleetPlot(Vertical):
    DEFAULT_CSS = """
    FleetPlot {
        height: auto;
        border: round $foreground 25%;
        border-title-color: $text-muted;
        padding: 0 1;
        display: none;
        &.fleet { display: block; }
        & > Horizontal { height: 1; }
        & Static.fleet-name { width: auto; max-width: 24; }
        & Static.fleet-total { width: auto; }
        & CountSparkline { width: 1fr; height: 1; margin: 0 1; }
        & #fleet-more { height: auto; }
    }
    """

    def __init__(self, *, id: str | None = None):
        super().__init__(id=id)
        self.border_title = "fleet over time · routing waste (tokens per interval, in all) · held twice (tokens, now)"
        self.shown: list[tuple[str, list[int], list[int], int]] = []

    def compose(self) -> ComposeResult:
        for index in range(MAX_REPLICAS):
            with Horizontal(id=f"fleet-row-{index}"):
                yield Static("", classes="fleet-name", markup=False)
                yield CountSparkline([], classes="fleet-waste")
                yield Static("", classes="fleet-total waste-total")
                yield CountSparkline([], classes="fleet-twice")
                yield Static("", classes="fleet-total twice-total")
        yield Static("", id="fleet-more")

    def show(self, view: StatsView) -> None:
        series = fleet_series(view)
        self.shown = series
        self.set_class(bool(series), "fleet")
        for index in range(MAX_REPLICAS):
            row = self.query_one(f"#fleet-row-{index}", Horizontal)
            row.display = index < len(series)
            if index >= len(series):
                continue
            origin, waste, twice, total = series[index]
            row.query_one(".fleet-name", Static).update(origin or "events")
            row.query_one(".fleet-waste", CountSparkline).data = waste
            row.query_one(".waste-total", Static).update(f"waste {total} ·")
            row.query_one(".fleet-twice", CountSparkline).data = twice
            row.query_one(".twice-total", Static).update(f"twice {twice[-1] if twice else 0}")
        more = len(series) - MAX_REPLICAS
        self.query_one("#fleet-more", Static).update(f"{more} more replicas (see the table)" if more > 0 else "")

"""The attach screen's server numbers: per publisher the blocks stored, removed, held (of the capacity its
metrics say), batches lost, events not decoded, blocks stored again soon after removal, and (once a publisher
restarted) its restarts and the blocks gone with them; stream integrity (removals of blocks never stored, hashes
stored while held, and once seen: blocks stored with a medium word kvtui does not know); once a server offloads,
blocks removed from one medium while another tier kept them and blocks loaded back to a faster one; where
several origins are followed, each one's routing waste and the fleet's totals; the prefix cache hit rate over
time (a sparkline of /metrics polls), lately, while watched and over the server's life."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from ...engine.server.metrics import MetricSample
from ...engine.server.view import OriginCounts, StatsView
from ..shared.count_sparkline import CountSparkline
from ..shared.palette import Palette, role_style


def hit_rates(samples: tuple[MetricSample, ...]) -> list[float]:
    """The plotted series: each poll's hit rate since the one before, or (where no poll saw queries yet)
    the rate since the server started."""
    rates = [s.rate for s in samples if s.rate is not None]
    if rates:
        return rates
    return [s.overall for s in samples if s.overall is not None]


def stat_columns(view: StatsView) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """The column names and, per publisher, its cells: the one list the table, its width and the narrow lines
    all read (the origin column only where there are several: the title names one). O(origins)."""
    several = len(view.origins) > 1
    restarted = any(stats.restarts for _, stats in view.origins)  # blocks gone with a restarted server: apart
    names = ("origin",) * several + ("stored", "removed", "held", "capacity", "lost", "undecodable", "restored")
    names += ("unknown", "dup hash")  # stream integrity: removals of blocks never stored, hashes stored while held
    names += ("routed",) * several  # tokens prefilled here while another replica held them
    names += ("restarts", "gone") * restarted
    # shown once any origin has one: a medium word kvtui does not know, and blocks on other tiers (offloading)
    odd_medium = any(stats.unknown_medium for _, stats in view.origins)
    tiers = any(stats.kept_elsewhere or stats.offloaded_back for _, stats in view.origins)
    names += ("unknown medium",) * odd_medium + ("kept on a tier", "loaded back") * tiers
    rows = []
    for origin, stats in view.origins:
        cells = (origin or "events",) * several
        cells += (str(stats.stored), str(stats.removed), str(stats.held), str(stats.capacity or "?"))
        cells += (str(stats.lost), str(stats.skipped), str(stats.restored))
        cells += (str(stats.unknown_removed), str(stats.stored_again))
        cells += (str(stats.routed_tokens),) * several
        cells += (str(stats.restarts), str(stats.gone)) * restarted
        cells += (str(stats.unknown_medium),) * odd_medium
        cells += (str(stats.kept_elsewhere), str(stats.offloaded_back)) * tiers
        rows.append(cells)
    return names, rows


def _cell_styles(stats: OriginCounts, palette: Palette | None) -> dict[str, str]:
    """held near the capacity is a warning, a lost batch an error."""
    styles = {}
    if stats.capacity and stats.held > 0.9 * stats.capacity:
        styles["held"] = role_style(palette, "warning")
    if stats.lost:
        styles["lost"] = role_style(palette, "error")
    return styles


def render_table(view: StatsView, palette: Palette | None = None) -> Table:
    """One row per publisher."""
    table = Table(expand=True, show_edge=False, pad_edge=False, box=None, header_style="bold")
    names, rows = stat_columns(view)
    for name in names:
        table.add_column(name, justify="left" if name == "origin" else "right", no_wrap=True)
    for (_, stats), cells in zip(view.origins, rows):
        styles = _cell_styles(stats, palette)
        table.add_row(*(Text(cell, style=styles.get(name, "")) for name, cell in zip(names, cells)))
    return table


def table_width(view: StatsView) -> int:
    """The cells the table needs: each column its widest header or value, and two between (render_table's cell
    padding, none at the edges). O(origins)."""
    names, rows = stat_columns(view)
    return sum(max(len(cell) for cell in column) for column in zip(names, *rows)) + 2 * (len(names) - 1)


def render_lines(view: StatsView, palette: Palette | None = None) -> Text:
    """The table's facts for a pane too narrow for its columns (80x24): one wrapping line per publisher,
    `stored 4 · removed 0 · held 4 of 364 · lost 0 · ...`, every number kept."""
    text = Text()
    names, rows = stat_columns(view)
    for index, ((_, stats), cells) in enumerate(zip(view.origins, rows)):
        if index:
            text.append("\n")
        styles = _cell_styles(stats, palette)
        pairs = list(zip(names, cells))
        if pairs and pairs[0][0] == "origin":
            text.append(f"{pairs.pop(0)[1]}: ", style="bold")
        for number, (name, cell) in enumerate(pairs):
            if name == "capacity":  # read with the one before: `held 4 of 364`
                text.append(f" of {cell}")
                continue
            text.append(" · " if number else "")
            text.append(f"{name} {cell}", style=styles.get(name, ""))
    return text


def rate_line(view: StatsView) -> str:
    parts = []
    watched = dict(view.watched)
    for origin, samples in view.samples:
        if not samples:
            continue
        last = samples[-1]
        latest = next((s.rate for s in reversed(samples) if s.rate is not None), None)
        words = [f"{origin}: hit rate"]
        words.append(f"{latest:.1%} lately" if latest is not None else "no queries lately")
        if origin in watched:
            words.append(f"· {watched[origin]:.1%} while watched")
        if last.overall is not None and last.queries is not None and last.hits is not None:
            words.append(f"· {last.overall:.1%} over the server's life ({last.hits:.0f} of {last.queries:.0f} tokens)")
        parts.append(" ".join(words))
    return "; ".join(parts) or "hit rate: no /metrics polled"


def fleet_line(view: StatsView) -> str:
    """Where several origins are followed: the tokens prefilled on one while another held them, and those held on
    more than one (memory spent twice), in all."""
    if len(view.origins) < 2:
        return ""
    routed = sum(stats.routed_tokens for _, stats in view.origins)
    twice = sum(tokens for _, tokens in view.twice)
    return f"\nfleet: routing waste {routed} tokens (prefilled while another replica held them) · held twice {twice}"


class ServerStats(Vertical):
    DEFAULT_CSS = """
    ServerStats {
        height: auto;
        border: round $foreground 25%;
        border-title-color: $text-muted;
        padding: 0 1;
        & > #stats-table { height: auto; }
        & > #stats-spark { height: 2; margin: 1 0 0 0; }
        & > #stats-rate { height: auto; }
    }
    """

    def __init__(self, *, id: str | None = None):
        super().__init__(id=id)
        self.border_title = "server"
        self.view: StatsView | None = None
        self._palette: Palette | None = None

    def compose(self) -> ComposeResult:
        yield Static("", id="stats-table")
        yield CountSparkline([], id="stats-spark", ceiling=1.0)  # hit rates: 0 to 100 %
        yield Static("hit rate: waiting for /metrics", id="stats-rate")

    def on_resize(self) -> None:
        if self.view is not None:
            self._show_table(self.view)

    def _show_table(self, view: StatsView) -> None:
        """The table where its columns fit, else the same facts as wrapping lines (no column dropped)."""
        width = self.content_size.width
        narrow = 0 < width < table_width(view)
        body = render_lines(view, self._palette) if narrow else render_table(view, self._palette)
        self.query_one("#stats-table", Static).update(body)

    def show(self, view: StatsView, palette: Palette | None = None) -> None:
        self.view = view
        self._palette = palette
        self._show_table(view)
        series: list[float] = []
        for _origin, samples in view.samples:
            series = hit_rates(samples)
            if series:
                break
        self.query_one("#stats-spark", CountSparkline).data = series
        self.query_one("#stats-rate", Static).update(rate_line(view) + fleet_line(view))
        held = sum(stats.held for _, stats in view.origins)
        capacity = sum(stats.capacity or 0 for _, stats in view.origins)
        share = f" of {capacity} ({held / capacity:.0%})" if capacity else ""
        name = view.origins[0][0] if len(view.origins) == 1 else f"{len(view.origins)} publishers"
        self.border_title = f"{name or 'server'} · blocks held {held}{share} · {view.chains} chains"

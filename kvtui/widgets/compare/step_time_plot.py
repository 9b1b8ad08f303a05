"""The compare screen's plot: ms per token against the context length, one line per cache strategy.

`render_plot(lanes, width, height)` is pure (a Rich Text, drawn by plotext, whose global figure it resets
each time: call it from one thread); `StepTimePlot` is a Static that redraws at most PLOT_HZ times a second.
"""

from __future__ import annotations

import time

from rich.text import Text
from textual.widgets import Static

PLOT_HZ = 4
COLORS = {"none": "red", "dynamic": "green", "static": "cyan", "static+compile": "magenta"}


def render_plot(lanes, width: int, height: int) -> Text:
    """Decode steps only (a prefill feeds many tokens; a compiling step is compile time, not a token)."""
    import plotext as plt

    series = [(lane.strategy, [(p.context, p.ms) for p in lane.decode]) for lane in lanes]
    if not any(points for _, points in series):
        return Text("ms per token against context length: waiting for the first decode steps…", style="dim")
    plt.clear_figure()
    plt.limitsize(False, False)  # plotext would clamp the plot to the terminal it guesses (80 columns off a tty)
    plt.plotsize(max(20, width), max(6, height))
    plt.theme("clear")
    for name, points in reversed(series):  # the first strategy drawn last: on top where lines overlap
        if points:
            plt.plot(
                [c for c, _ in points],
                [ms for _, ms in points],
                label=name,
                marker="braille",
                color=COLORS.get(name, "white"),
            )
    plt.xlabel("context length (tokens)")
    plt.ylabel("ms/token")
    return Text.from_ansi(plt.build())


class StepTimePlot(Static):
    DEFAULT_CSS = """
    StepTimePlot { height: 1fr; border: round $foreground 25%; border-title-color: $text-muted; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__("", **kwargs)
        self.border_title = "ms per token against context length"
        self._lanes = []
        self._drawn_at = 0.0

    def show(self, lanes, force: bool = False) -> None:
        self._lanes = lanes
        now = time.monotonic()
        if force or now - self._drawn_at >= 1 / PLOT_HZ:
            self._drawn_at = now
            self._draw()

    def on_resize(self, _event) -> None:
        self._draw()

    def _draw(self) -> None:
        size = self.content_region
        self.update(render_plot(self._lanes, size.width, size.height))

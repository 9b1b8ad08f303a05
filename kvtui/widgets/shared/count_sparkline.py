"""A sparkline of counts or rates drawn from zero: Textual's scales each plot from its own minimum to its maximum,
so a constant 128 (or a constant 90 % hit rate) is drawn at the bottom, like nothing, and one sample of 0 fills
the row. Here a bar's height is its value over the ceiling (the given one, e.g. 1.0 for a rate, else the
series' maximum): 0 is the bottom whatever the series, and a flat non-zero series is a flat bar at its height."""

from __future__ import annotations

from collections.abc import Sequence

from rich.color import Color, blend_rgb
from rich.console import Console, ConsoleOptions, RenderResult
from rich.segment import Segment
from rich.style import Style
from textual.renderables.sparkline import Sparkline as SparklineRenderable
from textual.widgets import Sparkline


class ZeroBasedRenderable(SparklineRenderable):
    def __init__(self, data: Sequence[float], *, ceiling: float | None, **options) -> None:
        super().__init__(data, **options)
        self.ceiling = ceiling

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = self.width or options.max_width
        height = self.height or 1
        top = self.ceiling or max(self.data, default=0) or 1  # all zeros: a flat bottom line
        columns = [self.summary_function(bucket) for bucket in self._buckets(list(self.data), num_buckets=width)]
        columns = [columns[index * len(columns) // width] for index in range(width)] if columns else [0] * width
        low, high = self.min_color.color, self.max_color.color
        steps = len(self.BARS) * height - 1  # bar segments over all lines
        for line in reversed(range(height)):
            for value in columns:
                ratio = min(max(value / top, 0.0), 1.0)
                index = int(ratio * steps) - line * len(self.BARS)
                if index < 0:  # an upper line, below this bar's top (the bottom line is never below: index >= 0)
                    yield Segment(" ")
                    continue
                bar = "█" if index >= len(self.BARS) else self.BARS[index]
                color = (
                    Color.from_triplet(blend_rgb(low.get_truecolor(), high.get_truecolor(), ratio))
                    if low and high
                    else None
                )
                yield Segment(bar, Style.from_color(color) if color else None)
            if line:
                yield Segment.line()


class CountSparkline(Sparkline):
    """Textual's Sparkline, its colours and CSS, with bars measured from zero (`ceiling`: the top, e.g. 1.0)."""

    def __init__(self, data: Sequence[float] | None = None, *, ceiling: float | None = None, **options) -> None:
        super().__init__(data, **options)
        self.ceiling = ceiling

    def render(self) -> ZeroBasedRenderable:
        plain = super().render()  # the library's colours, resolved from the CSS
        assert isinstance(plain, SparklineRenderable)
        return ZeroBasedRenderable(
            list(self.data or []),
            ceiling=self.ceiling,
            width=self.size.width,
            height=self.size.height,
            min_color=plain.min_color.color,
            max_color=plain.max_color.color,
            summary_function=self.summary_function,
        )

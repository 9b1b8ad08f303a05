"""The status line of every screen: one line of text (the step viewer: what the source is doing now, speed, step
time, cache bytes, model, device, dtype, cache kind, sampler, and two sparklines of step latency and cache size).

One line at every width: the numbers come first and are never cut; the source's description (parts joined by
" · ", most telling first) drops parts from its end, marked "…"; the sparklines give way before any text does.
The whole line is the text's tooltip."""

from __future__ import annotations

from collections import deque

from rich.cells import cell_len
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Sparkline, Static

from ...engine.records.snapshot import StepSnapshot
from ...fmt import printable, size
from .live_text import LiveText

HISTORY = 120  # points per sparkline
NUMBERS = " │ "  # between the step's numbers, and before the description
PARTS = " · "  # between the description's parts
# the cells the sparklines take with their labels and margins (the CSS below): "ms", 16 + 2, "cache", 16 + 2
SPARKLINE_CELLS = 2 + 18 + 5 + 18


def step_text(snapshot: StepSnapshot) -> str:
    """'step 12.3 ms', or with --compile 'compile 8.1 s · 0 recompiles' on the step that compiled."""
    if not snapshot.compiled:
        return f"step {snapshot.forward_ms:.1f} ms"
    recompiles = f"{snapshot.recompiles} recompile{'' if snapshot.recompiles == 1 else 's'}"
    if snapshot.compile_ms is not None:
        return f"compile {snapshot.compile_ms / 1000:.1f} s · {recompiles}"
    return f"step {snapshot.forward_ms:.1f} ms · compiled · {recompiles}"


def cache_text(snapshot: StepSnapshot) -> str:
    """'cache 2.1 MiB'; a paged cache (continuous batching), whose bytes the step does not read: its blocks in
    use, 'cache 6/16 blocks'."""
    if snapshot.paged:
        used = sum(group.used for group in snapshot.paged)
        total = sum(group.total for group in snapshot.paged)
        return f"cache {used}/{total} blocks"
    return f"cache {size(snapshot.cache_bytes)}"


def fit_line(numbers: list[str], description: str, width: int | None) -> str:
    """The numbers joined whole, then as many of the description's parts as fit in `width` cells, in order; left
    out parts are marked "…". Numbers that cannot all fit are dropped from the end, whole: a value is never cut.
    `width` None: everything."""
    parts = description.split(PARTS) if description else []
    whole = NUMBERS.join([*numbers, PARTS.join(parts)] if parts else numbers)
    if width is None or cell_len(whole) <= width:
        return whole
    for keep in range(len(parts) - 1, 0, -1):
        line = NUMBERS.join([*numbers, PARTS.join([*parts[:keep], "…"])])
        if cell_len(line) <= width:
            return line
    if parts and cell_len(NUMBERS.join([*numbers, "…"])) < width:
        return whole  # the description's first part, cut by the widget (ellipsis)
    for keep in range(len(numbers), 0, -1):
        line = NUMBERS.join([*numbers[:keep], "…"])
        if cell_len(line) <= width:
            return line
    return whole  # not even one number: cropped by the widget (ellipsis)


class StatusBar(Horizontal):
    DEFAULT_CSS = """
    StatusBar { height: 1; background: $panel; }
    StatusBar #status-state { width: auto; height: 1; padding: 0 1; margin-right: 1; text-style: bold;
                              background: $accent; color: $text; }
    StatusBar #status-text { width: 1fr; height: 1; padding-right: 1; text-wrap: nowrap; text-overflow: ellipsis; }
    StatusBar Sparkline { width: 16; height: 1; margin: 0 1; }
    StatusBar .label { width: auto; color: $text-muted; }
    StatusBar.-no-sparklines Sparkline, StatusBar.-no-sparklines .label { display: none; }
    """

    def __init__(self, *, sparklines: bool = True, **kwargs):
        """`sparklines`: the step viewer's step latency and cache size beside the text."""
        super().__init__(**kwargs)
        self.sparklines = sparklines
        self.latency: deque[float] = deque(maxlen=HISTORY)
        self.cache_size: deque[float] = deque(maxlen=HISTORY)
        self.model_text = "loading model…"
        self.state = ""  # what the source is doing (run mode, paused, following, ended): always shown
        # (numbers, description) fitted again on resize; no numbers: a line said as is (progress, an error)
        self._line: tuple[list[str], str] | None = None

    def compose(self) -> ComposeResult:
        yield Static(self.state, id="status-state", markup=False)
        yield LiveText(self.model_text, id="status-text", markup=False)
        if not self.sparklines:
            return
        yield Static("ms", classes="label")
        yield Sparkline([], id="latency", summary_function=max)
        yield Static("cache", classes="label")
        yield Sparkline([], id="cache-size", summary_function=max)

    def on_mount(self) -> None:
        self.set_state(self.state)

    def set_state(self, state: str) -> None:
        """The badge at the start of the line: what the source is doing now ("" hides it)."""
        self.state = state
        badge = self.query_one("#status-state", Static)
        badge.update(printable(state))
        badge.display = bool(state)
        if self._line is not None:
            self._fit()

    def set_text(self, text: str) -> None:
        self.model_text = text
        # a model name or an error may hold control characters: shown escaped
        self._line = ([], printable(text))
        self._fit()

    def show_text(self, text: Text) -> None:
        """A line with its own styles (a verdict in colour); the caller escaped what it did not write."""
        self._line = None  # said as given: a resize does not fit it again
        widget = self.query_one("#status-text", LiveText)
        widget.tooltip = text.plain
        widget.show_text(text)

    def record(self, snapshot: StepSnapshot) -> None:
        """One sparkline point per step. kvtui's own chat calls this from its engine reader thread for every
        step (deque appends: the UI thread paints copies); other sources once per snapshot shown."""
        self.latency.append(snapshot.forward_ms)
        self.cache_size.append(snapshot.cache_bytes)

    def show(self, snapshot: StepSnapshot | None, model_text: str, tokens_per_s: float | None) -> None:
        if snapshot is None:
            self.set_text(model_text)
            return
        speed = f"{tokens_per_s:.1f} tok/s" if tokens_per_s else "- tok/s"
        # the numbers that change first; the model's description after them, fitted (fit_line)
        self._line = ([speed, step_text(snapshot), cache_text(snapshot)], printable(model_text))
        self._fit()
        self.query_one("#latency", Sparkline).data = list(self.latency)
        self.query_one("#cache-size", Sparkline).data = list(self.cache_size)

    def on_resize(self) -> None:
        if self._line is not None:
            self._fit()

    def _fit(self) -> None:
        """The line in the cells the bar has: the sparklines only where the whole text fits beside them."""
        if not self.is_mounted:
            return  # compose shows model_text; on_mount fits it
        assert self._line is not None
        numbers, description = self._line
        width = self.size.width or None
        if width is not None and self.state:
            width -= cell_len(self.state) + 3  # the badge's padding and margin
        text_width = None if width is None else width - 1  # the text's right padding
        whole = fit_line(numbers, description, None)
        sparklines = self.sparklines and (text_width is None or cell_len(whole) <= text_width - SPARKLINE_CELLS)
        self.set_class(not sparklines, "-no-sparklines")
        widget = self.query_one("#status-text", LiveText)
        widget.tooltip = whole
        # no numbers: a line said as is (progress, an error), cut by the widget (ellipsis), never split into parts
        widget.show_text(Text(fit_line(numbers, description, text_width) if numbers else description))

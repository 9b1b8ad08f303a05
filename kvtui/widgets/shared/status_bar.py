"""The status line of every screen: one line of text (the step viewer: model, device, dtype, cache kind, speed,
cache bytes, and two sparklines of step latency and cache size)."""

from __future__ import annotations

from collections import deque

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Sparkline, Static

from ...engine.records.snapshot import StepSnapshot
from ...fmt import printable, size
from .live_text import LiveText

HISTORY = 120  # points per sparkline


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


class StatusBar(Horizontal):
    DEFAULT_CSS = """
    StatusBar { height: 1; background: $panel; }
    StatusBar #status-text { width: 1fr; height: 1; padding-right: 1; }  /* a gap before the first label */
    StatusBar Sparkline { width: 16; height: 1; margin: 0 1; }
    StatusBar .label { width: auto; color: $text-muted; }
    """

    def __init__(self, *, sparklines: bool = True, **kwargs):
        """`sparklines`: the step viewer's step latency and cache size beside the text."""
        super().__init__(**kwargs)
        self.sparklines = sparklines
        self.latency: deque[float] = deque(maxlen=HISTORY)
        self.cache_size: deque[float] = deque(maxlen=HISTORY)
        self.model_text = "loading model…"

    def compose(self) -> ComposeResult:
        yield LiveText(self.model_text, id="status-text")
        if not self.sparklines:
            return
        yield Static("ms", classes="label")
        yield Sparkline([], id="latency", summary_function=max)
        yield Static("cache", classes="label")
        yield Sparkline([], id="cache-size", summary_function=max)

    def set_text(self, text: str) -> None:
        self.model_text = text
        # Text, not markup; a model name or an error may hold control characters: shown escaped
        self.show_text(Text(printable(text)))

    def show_text(self, text: Text) -> None:
        """A line with its own styles (a verdict in colour); the caller escaped what it did not write."""
        self.query_one("#status-text", LiveText).show_text(text)

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
        # the numbers that change first: a narrow terminal cuts the model's description, not them
        self.set_text(f"{speed} │ {step_text(snapshot)} │ {cache_text(snapshot)} │ {model_text}")
        self.query_one("#latency", Sparkline).data = list(self.latency)
        self.query_one("#cache-size", Sparkline).data = list(self.cache_size)

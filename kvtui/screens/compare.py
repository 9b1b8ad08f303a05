"""The `kvtui compare` screen: one pane per cache strategy side by side, the ms-per-token plot under them,
and whether the tokens are still identical. The engines run in their own processes (kvtui/compare.py); a
worker thread drives them in lockstep and posts each update; the panes redraw on the app's thread."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.message import Message
from textual.widgets import Footer, Static

from .compare import CompareError, Comparison
from .themes import DEFAULT_THEME, load_themes
from .widgets.lane_pane import LanePane
from .widgets.palette import theme_palette
from .widgets.step_time_plot import StepTimePlot


@dataclass
class Updated(Message):
    done: bool = False
    error: str | None = None


class CompareApp(App):
    CSS = """
    #title { height: 1; padding: 0 1; color: $text-accent; text-style: bold; }
    #lanes { height: 2fr; }
    #plot { height: 3fr; }
    #verdict { height: 1; padding: 0 1; }
    """
    BINDINGS = [Binding("q", "quit", "Quit")]

    def __init__(
        self,
        model: str | None,
        strategies,
        options: dict,
        trace_dir: Path,
        script,
        theme_name: str | None = None,
        comparison: Comparison | None = None,
    ):
        super().__init__()
        for theme in load_themes().values():
            self.register_theme(theme)
        self.theme = theme_name or DEFAULT_THEME
        self.script = script
        self.comparison = comparison or Comparison(
            model, tuple(strategies), options, Path(trace_dir), on_update=lambda c, lane: self.post_message(Updated())
        )
        self.model_name = model or "embedded SmolLM2-135M-Instruct"
        self.outcome = 0
        self.finished = False

    def compose(self) -> ComposeResult:
        yield Static(f"kvtui compare · {self.model_name} · {len(self.script.turns)} turns", id="title")
        with Horizontal(id="lanes"):
            for lane in self.comparison.lanes:
                yield LanePane(lane.strategy, id=f"lane-{lane.strategy.replace('+', '-')}")
        yield StepTimePlot(id="plot")
        yield Static("loading the engines…", id="verdict")
        yield Footer()

    def on_mount(self) -> None:
        self.drive()

    @work(thread=True, exclusive=True, exit_on_error=False, group="compare")
    def drive(self) -> None:
        try:
            self.comparison.start()
            self.comparison.run(self.script.turns)
        except CompareError as exc:
            self.post_message(Updated(done=True, error=str(exc)))
            return
        self.post_message(Updated(done=True))

    def on_updated(self, message: Updated) -> None:
        palette = theme_palette(self)
        comparison = self.comparison
        for lane, pane in zip(comparison.lanes, self.query(LanePane)):
            pane.show(lane, palette)
        self.query_one(StepTimePlot).show(comparison.lanes, force=message.done)
        difference = comparison.first_difference(final=message.done)
        turn = f"turn {comparison.turn}/{len(self.script.turns)}" if comparison.turn else "loading"
        if message.error:
            verdict = f"[b red]error:[/] {message.error}"
            self.outcome = 2
        elif difference is not None:
            verdict = f"{turn} · [b red]tokens differ[/] from step {difference}"
        else:
            verdict = f"{turn} · tokens identical{' so far' if not message.done else ''}: [b green]yes[/]"
        if message.done and not message.error:
            self.finished = True
            verdict += " · done (q quits)"
            self.outcome = 0 if comparison.identical else 1
        self.query_one("#verdict", Static).update(verdict)

    def on_unmount(self) -> None:
        self.comparison.stop()

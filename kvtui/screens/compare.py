"""The `kvtui compare` screen: one pane per cache strategy side by side, the ms-per-token plot under them,
and whether the tokens are still identical. The engines run in their own processes (kvtui/compare.py); a
worker thread drives them in lockstep and posts each update; the panes redraw on the UI thread."""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.message import Message
from textual.widgets import Footer, Static

from ..compare import CompareError, Comparison
from ..keys import COMPARE_KEYS
from ..widgets.compare.step_time_plot import StepTimePlot
from ..widgets.compare.strategy_lane import StrategyLane
from ..widgets.shared.palette import theme_palette
from ..widgets.shared.status_bar import StatusBar
from .base import SourceScreen

HELP = """
The same greedy chat under each cache strategy, every strategy in an engine process of its own, advanced in
lockstep: one forward each, in turn, so they never compete for the cores. Each pane shows its strategy's
cache, speed and reply; the plot under them ms per token against the context length; the line at the bottom
whether every strategy chose the same tokens so far, and from which step they differ.
p holds the lockstep before its next round of forwards (each engine keeps its cache); p again goes on.
q stops the engines (their traces are kept) and quits.
"""


@dataclass
class Updated(Message):
    done: bool = False
    error: str | None = None


class CompareScreen(SourceScreen):
    CSS_PATH = "compare.tcss"
    BINDINGS = COMPARE_KEYS
    HELP_TITLE = "kvtui keys · compare"

    def __init__(self, comparison: Comparison, script, model_name: str):
        """`comparison`: the strategies' engines (not started: the screen starts them); `script`: the turns."""
        super().__init__()
        self.script = script
        self.comparison = comparison
        comparison.on_update = lambda c, lane: self.post_message(Updated())
        self.model_name = model_name
        self.outcome = 0
        self.finished = False
        self.paused = False
        self._verdict = Text("loading the engines…")

    def compose(self) -> ComposeResult:
        yield Static(f"kvtui compare · {self.model_name} · {len(self.script.turns)} turns", id="title", markup=False)
        with Horizontal(id="lanes"):
            for lane in self.comparison.lanes:
                yield StrategyLane(lane.strategy, id=f"lane-{lane.strategy.replace('+', '-')}")
        yield StepTimePlot(id="plot")
        yield StatusBar(id="verdict", sparklines=False)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#verdict", StatusBar).show_text(self._verdict)
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
        palette = theme_palette(self.app)
        comparison = self.comparison
        for lane, pane in zip(comparison.lanes, self.query(StrategyLane)):
            pane.show(lane, palette)
        self.query_one(StepTimePlot).show(comparison.lanes, force=message.done)
        difference = comparison.first_difference(final=message.done)
        turn = f"turn {comparison.turn}/{len(self.script.turns)}" if comparison.turn else "loading"
        if message.error:
            verdict = Text.assemble(("error:", "bold red"), f" {message.error}")
            self.outcome = 2
        elif difference is not None:
            verdict = Text.assemble(f"{turn} · ", ("tokens differ", "bold red"), f" from step {difference}")
        else:
            so_far = " so far" if not message.done else ""
            verdict = Text.assemble(f"{turn} · tokens identical{so_far}: ", ("yes", "bold green"))
        if message.done and not message.error:
            self.finished = True
            verdict.append(" · done (q quits)")
            self.outcome = 0 if comparison.identical else 1
        self._verdict = verdict
        self._show_verdict()

    def _show_verdict(self) -> None:
        line = self._verdict.copy()
        if self.paused and not self.finished:
            line.append(" · PAUSED (p goes on)")
        self.query_one("#verdict", StatusBar).show_text(line)

    # ---- what the chrome asks (screens/base.py) ----------------------------------------------------------

    def unavailable(self, action: str) -> str | None:
        if action == "pause" and self.finished:
            return "the comparison has finished: nothing to pause"
        return None

    def pause_source(self) -> None:
        self.paused = not self.paused
        self.comparison.pause(self.paused)
        self._show_verdict()

    def stop_source(self) -> None:
        self.comparison.stop()

    def help_notes(self) -> str:
        return HELP

"""`kvtui replay TRACE`: the same panes on a recorded trace, no model needed. Step forward and back."""

from __future__ import annotations

from pathlib import Path

from textual.css.query import NoMatches

from .app import KvtuiApp, SnapshotReady
from .engine.replay import Replay, describe_event, transcript
from .engine.trace import read_trace
from .options import AppConfig
from .widgets.chat_pane import ChatPane
from .widgets.status_bar import StatusBar

PLAY_INTERVAL = 0.1  # seconds between steps while playing


class ReplayApp(KvtuiApp):
    """Engine actions move through the recorded steps instead of calling a model."""

    UNAVAILABLE = {
        "verify": "replay is read-only: verify needs the live model (the verifies that ran are in the recording)",
        "force": "replay is read-only: forcing a token needs the live model",
        "sampler": "replay is read-only: the sampler belongs to the live model",
        "reset": "replay is read-only: there is no live cache to reset",
        "export_cache": "replay is read-only: a trace keeps no K/V tensors to export",
        "restart_engine": "replay runs no engine: it reads the recording",
        "watch": "replay is read-only: a token's rank needs the live distribution",
        "toggle_step_mode": "replay has no model: space and u step through the recording, r plays it",
        "next_script_turn": "replay has no model to send a script turn to",
        "focus_input": "replay has no model to type to",
    }

    def __init__(self, trace_path: Path, theme_name: str | None = None):
        super().__init__(AppConfig(theme=theme_name) if theme_name else AppConfig())
        self.replay = Replay(read_trace(trace_path))  # TraceError (file:line) before any screen opens
        self.trace_path = Path(trace_path)
        self.position = -1
        self._player = None

    def load_worker(self) -> None:  # nothing to load: show the recording
        self.model_text = self.replay.describe()
        self.query_one(StatusBar).set_text(self.model_text)
        chat = self.query_one(ChatPane)
        chat.input.disabled = True
        chat.input.placeholder = (
            f"replaying {self.trace_path.name}: {len(self.replay)} steps (space/u to step, r to play)"
        )
        self.query_one("#buffer").focus()
        if self.replay.trace.truncated:  # read_trace dropped a last line cut short by a crash
            self.notify(
                f"the recording was interrupted: {len(self.replay)} finished steps", severity="warning", timeout=10
            )
        if len(self.replay):
            self._goto(0)

    def _update_title(self) -> None:
        self.sub_title = "replay"
        try:
            self.query_one(ChatPane).border_title = f"kvtui · replay · {self.trace_path.name}"
        except NoMatches:  # not composed yet
            pass

    def _goto(self, index: int) -> None:
        index = max(0, min(index, len(self.replay) - 1))
        self.position = index
        snapshot = self.replay.snapshots[index]
        diagnostics = tuple(d for s in self.replay.snapshots[: index + 1] for d in s.diagnostics)
        self.post_message(SnapshotReady(snapshot, transcript(snapshot.buffer), diagnostics, running=False))
        if self._player is None:  # stepping: say what happened right after this step (not while playing)
            for event in self.replay.events_at(snapshot.step):
                failed = event.get("type") == "verify" and not event.get("ok")
                self.notify(
                    describe_event(event),
                    title=f"after step {snapshot.step}",
                    severity="error" if failed else "information",
                    timeout=6,
                )

    def _engine(self, action: str, argument=None) -> None:
        if action == "step":
            self._stop_player()
            self._goto(self.position + 1)
        elif action == "rewind":
            self._stop_player()
            self._goto(self.position - (argument or 1))
        elif action == "rewind_to":
            # the first recorded step whose buffer ends at the selected token
            target = next((i for i, s in enumerate(self.replay.snapshots) if len(s.buffer) > argument), self.position)
            self._goto(target)
        elif action == "run":
            if self._player is None:
                self._player = self.set_interval(PLAY_INTERVAL, self._advance)
        else:  # only a note: a SessionState here would clear the panes the recording fills
            self.notify(f"replay is read-only: '{action}' needs a live model", severity="warning")

    def _find_step(self, step: int):
        return next((s for s in self.replay.snapshots if s.step == step), None)

    def _advance(self) -> None:
        if self.position >= len(self.replay) - 1:
            self._stop_player()
            return
        self._goto(self.position + 1)

    def _stop_player(self) -> None:
        if self._player is not None:
            self._player.stop()
            self._player = None

    def action_pause(self) -> None:
        self._stop_player()

    def action_stop(self) -> None:
        if self.pinned_step is not None:
            self.action_live()
        self._stop_player()

    def action_save_trace(self) -> None:
        self.notify(f"this is a recorded trace: {self.trace_path}", timeout=5)

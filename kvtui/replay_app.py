"""`kvtui replay TRACE` and `kvtui replay --follow TRACE`: the same panes on a recorded trace, no model needed.
Step forward and back; with --follow, steps another process appends arrive as it writes them. Both read the
trace the same way (engine/replay.py), so a finished trace shows the same screen however it is opened."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from textual import work
from textual.css.query import NoMatches
from textual.message import Message
from textual.worker import get_current_worker

from .app import KvtuiApp, SnapshotReady
from .engine.replay import Replay, describe_event, transcript
from .engine.trace import Trace, TraceError, read_trace
from .options import AppConfig
from .widgets.chat_pane import ChatPane, program_step_text
from .widgets.status_bar import HISTORY, StatusBar

PLAY_INTERVAL = 0.1  # seconds between steps while playing


@dataclass
class Appended(Message):
    """The follower read more of the trace (one message however many records: the UI takes them all)."""


@dataclass
class FollowFailed(Message):
    error: str


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

    def __init__(self, trace_path: Path, theme_name: str | None = None, *, follow: bool = False):
        """`follow`: read the trace as another process writes it (a TraceError shows in the app); else it is
        read whole here (a TraceError, file:line, before any screen opens)."""
        super().__init__(AppConfig(theme=theme_name) if theme_name else AppConfig())
        self.trace_path = Path(trace_path)
        self.follow = follow
        self.replay = Replay(Trace(self.trace_path, {}) if follow else read_trace(trace_path))
        self.position = -1
        self.at_end = True  # following: each new step is shown as it arrives, until the person steps back
        self._player = None
        self._appended = False  # an Appended message is on its way: the follower posts no other

    def load_worker(self) -> None:  # nothing to load: show the recording
        chat = self.query_one(ChatPane)
        chat.input.disabled = True
        self.query_one("#buffer").focus()
        if self.follow:
            self.follow_trace()
        else:
            self._describe()
            if self.replay.trace.truncated:  # read_trace dropped a last line cut short by a crash
                self.notify(
                    f"the recording was interrupted: {len(self.replay)} finished steps", severity="warning", timeout=10
                )
            if len(self.replay):
                self._goto(0)

    def _describe(self) -> None:
        """The status line and the input's placeholder: the same for a finished and a followed trace."""
        self.model_text = self.replay.describe()
        self.query_one(StatusBar).set_text(self.model_text)
        self.query_one(
            ChatPane
        ).input.placeholder = f"replaying {self.trace_path.name}: {len(self.replay)} steps (space/u to step, r to play)"

    @work(thread=True, exclusive=True, exit_on_error=False, group="follow")
    def follow_trace(self) -> None:
        """Read the trace as it grows (engine/stream.py FollowSource); the UI shows what arrived."""
        from .engine.stream import FollowSource

        worker = get_current_worker()
        try:
            for record in FollowSource(self.trace_path).records(stop=worker.cancelled_event):
                self.replay.add_record(record)
                if not self._appended:
                    self._appended = True
                    self.post_message(Appended())
        except TraceError as exc:
            self.post_message(FollowFailed(str(exc)))

    def on_appended(self, message: Appended) -> None:
        self._appended = False  # first: records read from here on post another
        self._describe()
        if self.at_end and self._player is None and len(self.replay):
            self._goto(len(self.replay) - 1, quiet=True)

    def on_follow_failed(self, message: FollowFailed) -> None:
        self.notify(
            f"{message.error}\nfollowing stopped: the steps read so far stay here", severity="error", timeout=15
        )

    def _update_title(self) -> None:
        self.sub_title = "replay · following" if self.follow else "replay"
        try:
            self.query_one(ChatPane).border_title = f"kvtui · replay · {self.trace_path.name}"
        except NoMatches:  # not composed yet
            pass

    def _goto(self, index: int, quiet: bool = False) -> None:
        """Show recorded step `index`; `quiet`: without the notes of what happened right after it."""
        index = max(0, min(index, len(self.replay) - 1))
        self.position = index
        self.at_end = index == len(self.replay) - 1
        snapshot = self.replay.snapshots[index]
        self._prefill = self.replay.prefill_for(index)  # this turn's, however the step was reached
        # the sparklines and tok/s of the steps up to this one, however it was reached (played, stepped, followed)
        bar = self.query_one(StatusBar)
        bar.latency.clear()
        bar.cache_size.clear()
        self._recent_ms.clear()
        for recorded in self.replay.snapshots[max(0, index - HISTORY + 1) : index + 1]:
            bar.record(recorded)
            self._time_step(recorded)
        diagnostics = self.replay.diagnostics_through(index)
        self.post_message(SnapshotReady(snapshot, self._messages(snapshot), diagnostics, running=False, recorded=True))
        if self._player is None and not quiet:  # stepping: say what happened right after this step
            for event in self.replay.events_at(snapshot.step):
                failed = event.get("type") == "verify" and not event.get("ok")
                self.notify(
                    describe_event(event),
                    title=f"after step {snapshot.step}",
                    severity="error" if failed else "information",
                    timeout=6,
                )

    def _messages(self, snapshot) -> list[dict]:
        """A chat's transcript; for a watched program (whose output the trace does not hold) the text its
        cache holds at this step, which is what its next forward attends to."""
        if self.replay.header.get("mode") != "watch":
            return transcript(snapshot.buffer)
        name = snapshot.lineage or "no cache"
        return [{"role": f"{name} holds", "content": "".join(token.piece for token in snapshot.buffer)}]

    def _reuse_text(self, snapshot) -> str:
        if self.replay.header.get("mode") == "watch":  # a watched program's trace: where each forward came from
            return program_step_text(snapshot, 0, self.replay.recomputed_through(max(self.position, 0)))
        return super()._reuse_text(snapshot)

    def _engine(self, action: str, argument=None) -> None:
        if not len(self.replay):
            self.notify("no step recorded yet", severity="warning")
            return
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

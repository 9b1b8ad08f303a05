"""`kvtui replay TRACE` and `kvtui replay --follow TRACE`: the panes on a recorded trace, no model needed. Step
forward and back; with --follow, steps another process appends arrive as it writes them. Both read the trace
the same way (engine/records/replay.py), so a finished trace shows the same screen however it is opened."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from textual.binding import Binding
from textual.worker import get_current_worker

from ..engine.records.replay import Replay, describe_event, transcript
from ..engine.records.snapshot import StepSnapshot
from ..engine.records.token_bytes import run_text
from ..engine.records.trace import Trace, TraceError, read_trace
from ..messages import Call, SnapshotReady
from ..widgets.shared.status_bar import HISTORY
from ..widgets.step.chat_pane import ChatPane, program_step_text
from ..widgets.step.token_buffer import TokenBufferPane
from .base import Driver
from .reuse import ReuseMeter

PLAY_INTERVAL = 0.1  # seconds between steps while playing


class TraceDriver(Driver):
    """The keys that would act on a model move through the recorded steps instead."""

    EMPTY = "no step recorded yet"
    HELP = """
A recorded trace, read-only: space (or s) steps forward, u and backspace step back, r plays it, p or Esc stop
playing. With --follow the steps another process appends arrive as it writes them. n shows a recorded batch's
next row.
"""
    BINDINGS = [Binding("n", "next_row", "next batch row", show=False)]

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

    def __init__(self, trace_path: Path, *, follow: bool = False):
        """`follow`: read the trace as another process writes it (a TraceError shows in the app); else it is
        read whole here (a TraceError, file:line, before any screen opens)."""
        self.trace_path = Path(trace_path)
        self.follow = follow
        self.replay = Replay(Trace(self.trace_path, {}) if follow else read_trace(trace_path))
        self.position = -1
        self.at_end = True  # following: each new step is shown as it arrives, until the person steps back
        self._player: Any = None
        self._appended = False  # an "appended" call is on its way: the follower posts no other
        self.meter = ReuseMeter()  # a chat's trace: the line under the chat, as it was live

    def start(self) -> None:
        app = self.app
        app.query_one(ChatPane).input.disabled = True
        app.query_one(TokenBufferPane).focus()
        if self.follow:
            app.run_reader(self._follow, name="follow", group="follow")
            return
        self._describe()
        if self.replay.trace.truncated:  # read_trace dropped a last line cut short by a crash
            app.notify(
                f"the recording was interrupted: {len(self.replay)} finished steps", severity="warning", timeout=10
            )
        if len(self.replay):
            self._goto(0)

    def _describe(self) -> None:
        """The status line and the input's placeholder: the same for a finished and a followed trace."""
        app = self.app
        app.describe_model(self.replay.describe())
        app.query_one(
            ChatPane
        ).input.placeholder = f"replaying {self.trace_path.name}: {len(self.replay)} steps (space/u to step, r to play)"

    def _follow(self) -> None:
        """(worker thread) Read the trace as it grows (records/follow.py); the UI shows what arrived. A rewritten
        trace (the program run again) is read into a fresh Replay, which the UI takes over (_restarted)."""
        from ..engine.records.follow import FOLLOW, REWRITTEN, FollowSource

        worker = get_current_worker()
        replay = self.replay
        try:
            for record in FollowSource(self.trace_path).records(stop=worker.cancelled_event):
                if record.get("type") == FOLLOW:
                    if record.get("what") == REWRITTEN:
                        replay = Replay(Trace(self.trace_path, {}))
                        self.app.post_message(Call(self._restarted, (replay, record["message"])))
                    else:  # waiting for the file
                        self.app.post_message(Call(self._waiting, (record["message"],)))
                    continue
                replay.add_record(record)
                if not self._appended:
                    self._appended = True
                    self.app.post_message(Call(self._appended_records))
        except TraceError as exc:
            self.app.post_message(Call(self._follow_failed, (str(exc),)))

    def _waiting(self, message: str) -> None:
        self.app.describe_model(message)  # the status line: not "loading model…", there is no model
        self.app.query_one(ChatPane).input.placeholder = f"{message} (the program has not created it yet)"
        self.app.notify(f"{message}: its steps show as the program writes them", timeout=10)

    def _restarted(self, replay: Replay, message: str) -> None:
        """The trace was rewritten: the steps read from here on are the new run's, from its first step."""
        self._stop_player()
        self.replay, self.position, self.at_end = replay, -1, True
        self.app.notify(message, severity="warning", timeout=10)
        self._appended_records()

    def _appended_records(self) -> None:
        self._appended = False  # first: records read from here on post another
        self._describe()
        if self.at_end and self._player is None and len(self.replay):
            self._goto(len(self.replay) - 1, quiet=True)

    def _follow_failed(self, error: str) -> None:
        self.app.notify(f"{error}\nfollowing stopped: the steps read so far stay here", severity="error", timeout=15)

    def title(self) -> tuple[str, str]:
        if self._player is not None:
            state = "replay · playing"
        elif self.follow and self.at_end:
            state = "replay · following"
        else:  # stepped back (following waits for the end again), or a finished recording
            where = "end" if self.at_end else f"step {self.position + 1} of {len(self.replay)}"
            state = f"replay · {'following paused' if self.follow else where}"
        return state, f"kvtui · replay · {self.trace_path.name}"

    def _goto(self, index: int, quiet: bool = False) -> None:
        """Show recorded step `index`; `quiet`: without the notes of what happened right after it."""
        app = self.app
        index = max(0, min(index, len(self.replay) - 1))
        self.position = index
        self.at_end = index == len(self.replay) - 1
        snapshot = self.replay.snapshots[index]
        self.meter.prefill = self.replay.prefill_for(index)  # this turn's, however the step was reached
        # the sparklines and tok/s of the steps up to this one, however it was reached (played, stepped, followed)
        app.replay_step_history(self.replay.snapshots[max(0, index - HISTORY + 1) : index + 1])
        diagnostics = self.replay.diagnostics_through(index)
        app.post_message(SnapshotReady(snapshot, self._messages(snapshot), diagnostics, running=False, recorded=True))
        if self._player is None and not quiet:  # stepping: say what happened right after this step
            for event in self.replay.events_at(snapshot.step):
                failed = event.get("type") == "verify" and not event.get("ok")
                app.notify(
                    describe_event(event),
                    title=f"after step {snapshot.step}",
                    severity="error" if failed else "information",
                    timeout=6,
                )

    def _messages(self, snapshot: StepSnapshot) -> list[dict]:
        """A chat's transcript; for a watched program (whose output the trace does not hold) the text its
        cache holds at this step, which is what its next forward attends to."""
        if self.replay.header.get("mode") != "watch":
            return transcript(snapshot.buffer, snapshot.token_bytes)
        name = snapshot.lineage or "no cache"
        buffer = snapshot.for_row(self.row).buffer
        held = run_text(((t.id, t.piece) for t in buffer), snapshot.token_bytes)
        return [{"role": f"{name} holds", "content": held}]

    def reuse_text(self, snapshot: StepSnapshot) -> str:
        if self.replay.header.get("mode") == "watch":  # a watched program's trace: where each forward came from
            row = self.row if self.row < snapshot.batch else 0  # a step of a smaller batch shows its first row
            return program_step_text(snapshot, row, self.replay.recomputed_through(max(self.position, 0)))
        return self.meter.text(snapshot)

    def command(self, action: str, argument: Any = None) -> None:
        if not len(self.replay):
            self.app.notify("no step recorded yet", severity="warning")
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
                self._player = self.app.set_interval(PLAY_INTERVAL, self._advance)
                self.app.update_title()
        else:  # only a note: a SessionState here would clear the panes the recording fills
            self.app.notify(f"replay is read-only: '{action}' needs a live model", severity="warning")

    def find_step(self, step: int) -> StepSnapshot | None:
        return self.replay.snapshot_at(step)

    def show_row(self) -> None:  # the recorded step again: its chat text is the row's too
        if self.position >= 0:
            self._goto(self.position, quiet=True)

    def _advance(self) -> None:
        if self.position >= len(self.replay) - 1:
            self._stop_player()
            return
        self._goto(self.position + 1)

    def _stop_player(self) -> None:
        if self._player is not None:
            self._player.stop()
            self._player = None
            self.app.update_title()  # no longer playing

    def pause(self) -> None:
        self._stop_player()

    def stop_turn(self) -> None:
        self._stop_player()

    def save_trace(self) -> None:
        self.app.notify(f"this is a recorded trace: {self.trace_path}", timeout=5)

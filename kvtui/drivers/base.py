"""What the step viewer and its source ask of each other: `Viewer`, all a driver may ask of the screen showing it
(screens/step.py StepScreen), and `Driver`, all the screen asks of its source (the defaults are those of a
source that takes no command)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from textual.binding import Binding
from textual.widget import Widget

from ..engine.records.snapshot import StepSnapshot
from ..widgets.step.chat_pane import ChatPane

if TYPE_CHECKING:
    from textual.message import Message
    from textual.notifications import SeverityLevel
    from textual.screen import Screen
    from textual.timer import Timer

    from ..engine.chat.remote import RemoteSession
    from ..engine.records.snapshot import Diagnostic, TopToken

WidgetType = TypeVar("WidgetType", bound=Widget)
ScreenResult = TypeVar("ScreenResult")


def ui_cpu() -> float | None:
    """CPU seconds the UI (main) thread has used so far; None where the OS cannot tell."""
    ident = threading.main_thread().ident
    if ident is None:
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (AttributeError, OSError, TypeError):
        return None


def cache_line(snapshot: StepSnapshot) -> str:
    """The line under the chat where there is no turn's prefill to measure."""
    return f"turn {snapshot.turn} · cache {snapshot.cache_seq_length} tokens · step {snapshot.step}"


class Viewer(Protocol):
    """What a driver may ask of the screen that shows it (StepScreen), and all it may: the screen's state it
    reads, a few of Textual's own methods, and the viewer's methods below. Every member is for the UI thread, except
    `post_message` and `record_step`, which a source's worker thread may call."""

    # ---- the app's state, read only -----------------------------------------------------------------

    @property
    def title(self) -> str: ...

    @property
    def step_mode(self) -> bool:
        """Enter only prefills; space steps (m toggles it)."""
        ...

    @property
    def latest(self) -> StepSnapshot | None:
        """The newest step the app was given (None before the first, or after a rewind to nothing)."""
        ...

    @property
    def model_text(self) -> str:
        """What the status line says of the source between steps (`describe_model` sets it)."""
        ...

    @property
    def screen(self) -> Screen[object]: ...

    # ---- Textual's ----------------------------------------------------------------------------------

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity: SeverityLevel = "information",
        timeout: float | None = None,
        markup: bool = False,
    ) -> None: ...

    def post_message(self, message: Message) -> bool:
        """Thread-safe: how a source's worker thread hands the app its steps (SnapshotReady), its state
        (SessionState) and the rest (Call), in order."""
        ...

    def query_one(self, selector: type[WidgetType]) -> WidgetType: ...

    def set_interval(self, interval: float, callback: Callable[[], Any]) -> Timer: ...

    def push_screen(self, screen: Screen[ScreenResult], callback: Callable[[ScreenResult | None], None]) -> Any: ...

    # ---- the viewer's ---------------------------------------------------------------------------------

    def run_reader(self, read: Callable[[], None], *, name: str, group: str) -> None:
        """Run `read` (a source's reader) in a thread worker of its own: one at a time in `group`; an error
        in it becomes a `worker-error` alarm, the app goes on."""
        ...

    def describe_model(self, text: str, *, status: str | None = None) -> None:
        """What the status line says of the source (the model, the program, the trace), shown now and beside
        every step's numbers; `status`: shown now instead (an error line)."""
        ...

    def show_status(self, text: str) -> None:
        """The status line says `text` until the next step repaints it (progress, a stopped engine)."""
        ...

    def record_step(self, snapshot: StepSnapshot) -> None:
        """A step's sparkline points and tok/s sample. Safe on a source's worker thread (deque appends, which
        the UI thread reads as copies when it paints): there every step counts, also one whose SnapshotReady
        a newer one replaced."""
        ...

    def replay_step_history(self, snapshots: Sequence[StepSnapshot]) -> None:
        """The sparklines and the tok/s window hold these steps and no others (a trace shown at a step)."""
        ...

    def show_diagnostics(self, diagnostics: tuple[Diagnostic, ...] | None = None) -> None:
        """The source's alarms so far (None: those the app holds) with the app's own, in the diagnostics pane
        and the alarm line."""
        ...

    def report_error(self, alarm: str, text: str, next_steps: str, title: str, timeout: float = 10) -> None:
        """A `worker-error` alarm at the live step (the source never saw it), and a notice saying what next."""
        ...

    def update_title(self) -> None:
        """The sub-title and the chat pane's border title again, from the driver's `title()`."""
        ...

    def show_live(self) -> None:
        """Repaint the live step (unless one is pinned): what the driver shows of it changed."""
        ...

    def show_next_script_turn(self) -> None:
        """The input's placeholder again, from the driver's `input_placeholder()`."""
        ...


class Driver:
    """One source of the app. Every method runs on the UI thread, except where it says otherwise. The app calls
    nothing else: a capability only some sources have is here too, and does nothing (or says it is not
    available) by default."""

    # keys of this source's own: each replaces the app's binding of the same key (the app's actions; see app.py)
    BINDINGS: ClassVar[list[Binding]] = []
    # actions this source cannot honour, with why: the key is dimmed, help says why, pressing it changes nothing
    UNAVAILABLE: ClassVar[dict[str, str]] = {}
    # help's words on this source, above the step viewer's notes on its panes
    HELP: ClassVar[str] = ""
    # what the cache pane says before the first step, in this source's words
    EMPTY: ClassVar[str] = "cache empty: no step yet"
    app: Viewer  # the screen showing this source (StepScreen; set by attach, before it is mounted)
    # a live session's facts as its records say (kvtui's own chat, once its model is loaded); None for others
    session: RemoteSession | None = None
    row = 0  # the batch row the panes show (`n`; kvtui's own chat is one row)

    def attach(self, app: Viewer) -> None:
        self.app = app

    def start(self) -> None:
        """The app is mounted: start reading the source (in a worker thread)."""

    def stop(self) -> None:
        """End the source (its process, its files). Blocking; the app calls it off the UI thread on quit, and
        again as it unmounts (a second call returns at once)."""

    def unavailable(self, action: str) -> str | None:
        """Why `action` cannot run on this source (None: it can)."""
        return self.UNAVAILABLE.get(action)

    def command(self, action: str, argument: Any = None) -> None:
        """A key that acts on the model or the program: step, run, rewind, rewind_to, force, verify, export,
        reset, send, sampler."""
        self.app.notify(self.unavailable(action) or f"'{action}' is not available here", severity="warning")

    @property
    def busy(self) -> bool:
        """A command is still running at the source (or on its way there)."""
        return False

    def pause(self) -> None:
        self.command("pause")

    def stop_turn(self) -> None:
        """Escape with nothing pinned or focused."""

    def title(self) -> tuple[str, str]:
        """(the app's sub-title, the chat pane's border title)."""
        return "", self.app.title

    def shown(self, snapshot: StepSnapshot | None) -> StepSnapshot | None:
        """The snapshot the panes draw for a step (a watched batch, live or recorded: the selected row)."""
        return snapshot.for_row(self.row) if snapshot is not None else None

    def reuse_text(self, snapshot: StepSnapshot) -> str:
        """The line under the chat (kvtui's chat: the reuse meter, drivers/reuse.py)."""
        return cache_line(snapshot)

    def next_turn(self) -> str | None:
        """Enter with nothing typed: the text to send (a script's next turn), or None."""
        return None

    def input_placeholder(self) -> str:
        """What the chat's input line says while empty."""
        return "Enter or i: type a message (Enter sends it)"

    def find_step(self, step: int) -> StepSnapshot | None:
        return None

    def state(self, record: dict) -> None:
        """The source's `state` record after a command (SessionState), before the app shows it."""

    def save_trace(self) -> None:
        self.app.notify("this source records no trace", severity="warning")

    def focus_input(self) -> None:
        self.app.query_one(ChatPane).input.focus()

    def sampler(self) -> None:
        self.command("sampler")

    def watch(self, token: TopToken) -> None:
        self.command("watch", token.id)

    def attention(self, layer: int) -> None:
        """A layer was selected: the source may send that layer's attention from the next forward."""

    def restart(self) -> None:
        self.command("restart_engine")

    # ---- keys only a watched program binds (ProgramDriver.BINDINGS) -----------------------------------

    def toggle_break_on_alarm(self) -> None:
        """b: pause the source after a step that raised an alarm (or stop doing so)."""
        self.command("break_on_alarm")

    def next_row(self) -> None:
        """n (bound by the sources whose steps may be batches): show the next row of the step's batch."""
        latest = self.app.latest
        batch = latest.batch if latest is not None else 1
        self.row = (self.row + 1) % batch
        if batch == 1:
            self.app.notify("batch of one: no other row", timeout=2)
        self.show_row()

    def show_row(self) -> None:
        """Repaint the step shown, now seen from `row`."""
        self.app.show_live()

    def next_model(self) -> None:
        """M: show one model's steps, then the next model's, then every model's."""
        self.command("next_model")

    # ---- a program's stdin: only a source that mounts a ProgramInput hears from it --------------------

    def send_line(self, text: str) -> None:
        """A line typed to the program (a newline follows it)."""

    def end_input(self) -> None:
        """ctrl+d in the program's input: close its stdin."""

    def interrupt(self) -> None:
        """ctrl+c in the program's input: interrupt it."""

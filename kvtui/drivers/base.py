"""What the app asks of its source. The defaults are those of a source that takes no command."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, ClassVar

from textual.binding import Binding

from ..engine.records.snapshot import StepSnapshot
from ..widgets.chat_pane import ChatPane

if TYPE_CHECKING:
    from ..engine.records.snapshot import TopToken


def ui_cpu() -> float | None:
    """CPU seconds the UI (main) thread has used so far; None where the OS cannot tell."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(threading.main_thread().ident))
    except (AttributeError, OSError, TypeError):
        return None


class Driver:
    """One source of the app. Every method runs on the UI thread, except where it says otherwise."""

    # keys of this source's own: each replaces the app's binding of the same key (the app's actions; see app.py)
    BINDINGS: ClassVar[list[Binding]] = []
    # actions this source cannot honour, with why: the key is dimmed, help says why, pressing it changes nothing
    UNAVAILABLE: ClassVar[dict[str, str]] = {}
    app: Any  # the KvtuiApp showing this source (set by attach, before the app is mounted)

    def attach(self, app: Any) -> None:
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
        """The snapshot the panes draw for a step (a watched batch: the selected row)."""
        return snapshot

    def reuse_text(self, snapshot: StepSnapshot) -> str | None:
        """The line under the chat; None: the app's reuse meter (what this turn took from the cache)."""
        return None

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

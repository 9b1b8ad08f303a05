"""The step viewer: a sequence of forward steps, whatever its source (kvtui/drivers: kvtui's own chat in the
engine process, a trace, a watched program or process tree). Widgets render snapshots, nothing else.

The screen takes its source as an argument. The source's worker thread posts snapshots (`post_message` is
thread-safe; snapshots coalesce in run mode); keys become the source's commands (step_keys.py), and a key the
source cannot honour is dimmed, with the reason in help and in the note a press gives. A source asks of the
screen only what drivers/base.py `Viewer` lists; the screen calls on it only what `Driver` declares.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.reactive import reactive
from textual.timer import Timer
from textual.widgets import Footer
from textual.worker import Worker, WorkerState

from ..drivers.base import Driver
from ..engine.chat.remote import RemoteSession
from ..engine.records.snapshot import Diagnostic, RequestView, StepSnapshot
from ..engine.records.token_bytes import unfinished_tail
from ..keys import APP_KEYS
from ..messages import Call, SessionState, SnapshotReady
from ..options import AppConfig
from ..widgets.shared.status_bar import StatusBar
from ..widgets.step.alarm_line import AlarmLine
from ..widgets.step.attention_strip import AttentionStrip, shading
from ..widgets.step.chat_pane import ChatPane
from ..widgets.step.cursor_pane import CursorPane
from ..widgets.step.diagnostics_pane import DiagnosticsPane
from ..widgets.step.layers_pane import LayersPane
from ..widgets.step.requests_pane import RequestsPane, picked_request
from ..widgets.step.token_buffer import TokenBufferPane
from ..widgets.step.topk_pane import TopKPane
from .step_keys import StepKeys

# pane repaints per second at most while the model runs when no core is spare: each repaint takes CPU the engine
# could use
REFRESH_HZ = 2
SHIPPED_REFRESH_HZ = REFRESH_HZ  # benchmarks patch REFRESH_HZ to fix the rate; a patched value is used as is
MAX_REFRESH_HZ = 15  # with a core to spare (many cores, or a model that waits on a GPU) the panes follow at up to this
SPARE_CHECK_S = 1.0  # how often the spare CPU is looked at


def spare_cores() -> float | None:
    """Cores not busy over the last minute (CPU count minus the load average); None where the OS cannot tell."""
    try:
        return (os.cpu_count() or 1) - os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


__all__ = ["SessionState", "SnapshotReady", "StepScreen"]

KEPT_REQUEST_VIEWS = 256  # requests whose newest view the screen remembers (the requests pane's departed rows)
PANES = ("buffer", "cursor", "topk", "layers", "diagnostics")
SESSION_KEPT = "the session is as it was before this action: go on, v verifies it, q quits"


STEP_NOTES = """
Special tokens show whole in the cache pane (its cells widen for them, up to 32 cells); the selected
token's whole piece, id, position and origin show in the cursor pane.
Shapes: `K=V 3×125×64` is kv_heads×tokens×head_dim with batch 1 left out when K and V are alike;
`K 1×12×16 V 1×12×8` when they differ; `b2` marks a batch of 2.
Short terminals fold the layers and diagnostics panes (F5 / F6 show them; the alarm line shows the top
alarm meanwhile); they unfold when the terminal grows. In diagnostics, x expands an alarm group; Enter on
one shows its step (g goes back to the live step).
A forward that packs several requests (continuous batching: a watched server or generate_batch) lists them
above the cache pane: n picks the next request (or arrows / click in the list, F7 hides it); the cache,
cursor and top-k panes show the picked request, and the cursor pane says when this forward did not feed it.
The layers pane shows the paged cache's blocks per group: used (shared), cached for reuse, free.
--attention (opt-in) costs O(cache) per step: it reads the newest query's attention over every position.
"""


class RequestViews:
    """Each request's newest view, from every step given (painted or not): a request that left between two
    repaints is listed as it ended, not as the last painted step saw it. Only a source that packs requests
    (continuous batching) fills it; a source's reader thread writes it, the UI thread copies it."""

    def __init__(self) -> None:
        self._views: OrderedDict[str, RequestView] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, views: Sequence[RequestView]) -> None:
        with self._lock:
            for view in views:
                self._views[view.request_id] = view
                self._views.move_to_end(view.request_id)
            while len(self._views) > KEPT_REQUEST_VIEWS:
                self._views.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._views.clear()

    def copy(self) -> dict[str, RequestView]:
        with self._lock:
            return dict(self._views)


class StepScreen(StepKeys):
    TITLE = "kvtui"
    step_mode = reactive(False)  # Enter only prefills; space steps
    CSS_PATH = "step.tcss"
    BINDINGS = APP_KEYS  # keys.py: every key of the step viewer, one table

    def __init__(self, config: AppConfig, source: Driver):
        """`config`: a ready AppConfig (the CLI builds and validates it); `source`: what the screen shows (a
        ChatDriver, a TraceDriver, a ProgramDriver)."""
        super().__init__()
        self.config = config
        self.driver: Driver = source
        self.driver.attach(self)
        for binding in self.driver.BINDINGS:  # the source's own keys replace the app's (this instance's map)
            for key in binding.key.split(","):
                self._bindings.key_to_bindings[key.strip()] = [replace(binding, key=key.strip())]
        self.latest: StepSnapshot | None = None
        self.attention_view: tuple[int | None, int | None] = (None, None)  # (layer: None = all, head: None = mean)
        self.pinned_step: int | None = None
        self.diagnostics: tuple[Diagnostic, ...] = ()
        self.app_diagnostics: list[Diagnostic] = []  # worker errors: the engine never saw them
        self.messages: list[dict] = []
        self.model_text = "loading model…"
        self.hidden: set[str] = set()  # panes the user hid
        self.shown: set[str] = set()  # panes the user showed although the layout folds them
        self.packed = False  # the shown step packed many requests (continuous batching): the requests pane shows
        self._recent_ms: deque[float] = deque(maxlen=16)
        self.request_views = RequestViews()
        self._last_paint = 0.0
        self._paint_timer: Timer | None = None
        self._auto_hz: float = REFRESH_HZ
        self._hz_checked = float("-inf")

    def push_screen(self, screen, callback=None) -> Any:
        """A modal of the source's (the sampler): on top of this screen."""
        return self.app.push_screen(screen, callback)

    def unavailable(self, action: str) -> str | None:
        """Why `action` cannot run on this screen's source (None: it can)."""
        return self.driver.unavailable(action)

    def help_notes(self) -> str:
        return f"{self.driver.HELP.strip()}\n{STEP_NOTES.strip()}".strip()

    # ---- layout ----------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            yield ChatPane(id="chat")
            with Vertical(id="inspect"):
                yield RequestsPane(id="requests")
                yield TokenBufferPane(id="buffer")
                yield AttentionStrip(id="attention-strip")
                with Horizontal(id="row2"):
                    yield CursorPane(id="cursor")
                    yield TopKPane(id="topk")
                with Horizontal(id="row3"):
                    yield LayersPane(id="layers")
                    yield DiagnosticsPane(id="diagnostics")
        yield AlarmLine(id="alarm-line")
        yield StatusBar(id="status")
        yield Footer()

    def on_mount(self) -> None:
        self._status_bar = self.query_one(StatusBar)  # for record_step on a reader thread: no DOM query there
        self.app.theme_changed_signal.subscribe(self, lambda _theme: self._apply_layout())
        self.query_one(TokenBufferPane).empty_text = self.driver.EMPTY
        self._apply_layout()
        # the panes hold the keys at start-up (q quits, ? helps); Enter or i moves to the input
        self.query_one(TokenBufferPane).focus()
        self.update_title()
        self.driver.start()

    def on_resize(self, event) -> None:
        self._apply_layout(event.size)

    def _apply_layout(self, size=None) -> None:
        """Reflow at every size: narrow terminals (< 110 columns) get a thinner chat, short ones (< 32 rows)
        fold the layers and diagnostics row (the cursor pane still shows every layer's K/V shape, the alarm
        line the top alarm) until F5 / F6 shows it; a terminal that grows unfolds it again."""
        width, height = size if size is not None else self.size
        self.set_class(width < 110, "narrow")
        self.set_class(height < 32, "short")
        self.set_class(self.app.theme == "kvtui-projector", "roomy")
        hidden = self._hidden_panes(height)
        for name in PANES:
            self.query_one(f"#{name}").display = name not in hidden
        self.query_one("#row2").display = not ({"cursor", "topk"} <= hidden)
        self.query_one("#row3").display = not ({"layers", "diagnostics"} <= hidden)
        self.query_one(AlarmLine).display = "diagnostics" in hidden
        self.query_one(RequestsPane).display = self.packed and "requests" not in hidden

    def _hidden_panes(self, height: int | None = None) -> set[str]:
        height = self.size.height if height is None else height
        folded = {"layers", "diagnostics"} if height < 32 or self.app.theme == "kvtui-projector" else set()
        return self.hidden | (folded - self.shown)

    # ---- the source -------------------------------------------------------------------------------

    @property
    def session(self) -> RemoteSession | None:
        """A live session's facts as its records say (kvtui's own chat's, once its model is loaded)."""
        return self.driver.session

    @property
    def engine_busy(self) -> bool:
        """A command is still running at the source (or on its way there)."""
        return self.driver.busy

    def on_call(self, message: Call) -> None:
        message.callback(*message.args)

    # ---- what a source may ask of the app (drivers/base.py Viewer; UI thread unless it says otherwise) ----

    def run_reader(self, read: Callable[[], None], *, name: str, group: str) -> None:
        """`read` in a thread worker, one at a time in `group`; its error becomes an alarm (below)."""
        self.run_worker(read, name=name, group=group, thread=True, exclusive=True, exit_on_error=False)

    def describe_model(self, text: str, *, status: str | None = None) -> None:
        """What the status line says of the source beside each step's numbers: shown now (or `status`)."""
        self.model_text = text
        if status is None and self.latest is not None:  # beside the shown step's numbers, as each paint does
            self._show_step_status(self.latest)
            return
        self.show_status(text if status is None else status)

    def show_status(self, text: str) -> None:
        """The status line says `text` until the next step repaints it (progress, a stopped engine)."""
        self.query_one(StatusBar).set_text(text)

    def record_step(self, snapshot: StepSnapshot) -> None:
        """A step's sparkline points and tok/s sample (decode steps only: a compiling step is not a slow one).
        Safe on a source's reader thread: deque appends, which the UI thread reads as copies when it paints."""
        self._status_bar.record(snapshot)
        if snapshot.requests:
            self.request_views.add(snapshot.requests)
        if snapshot.phase == "decode" and snapshot.compile_ms is None:
            self._recent_ms.append(snapshot.forward_ms + snapshot.snapshot_ms)

    def replay_step_history(self, snapshots: Sequence[StepSnapshot]) -> None:
        """The sparklines and the tok/s window hold these steps and no others."""
        self._status_bar.latency.clear()
        self._status_bar.cache_size.clear()
        self._recent_ms.clear()
        self.request_views.clear()
        for snapshot in snapshots:
            self.record_step(snapshot)

    def show_live(self) -> None:
        """Repaint the live step (unless one is pinned): what the driver shows of it changed (another row)."""
        if self.latest is not None and self.pinned_step is None:
            self._show(self.latest)
            self._show_chat()

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.state == WorkerState.ERROR:
            error = event.worker.error
            text = f"{type(error).__name__}: {error}"
            self.report_error(
                f"{event.worker.name}: {text}", text, SESSION_KEPT, "error in the model worker (session kept)"
            )

    def report_error(self, alarm: str, text: str, next_steps: str, title: str, timeout: float = 10) -> None:
        """A `worker-error` alarm at the live step (the source never saw it), and a notice saying what next."""
        step = self.latest.step if self.latest else 0
        self.app_diagnostics.append(Diagnostic("worker-error", "error", alarm, step))
        self.show_diagnostics()
        self.notify(f"{text}\n{next_steps}", title=title, severity="error", timeout=timeout)

    # ---- snapshots -> panes ----------------------------------------------------------------------

    def on_snapshot_ready(self, message: SnapshotReady) -> None:
        snapshot = message.snapshot
        self.latest = snapshot
        self.diagnostics = message.diagnostics
        if message.messages is not None:
            self.messages = message.messages
        if self.session is not None and message.facts is not None:
            self.session.update(message.facts)
            self.session.buffer = snapshot.buffer
        if not message.recorded:
            self.record_step(snapshot)
        # Repaint at most repaint_hz times a second: on 2 busy cores every repaint takes CPU from the engine process.
        wait = self._last_paint + 1 / self.repaint_hz() - time.monotonic()
        if wait <= 0 or not message.running:  # single steps paint at once
            if self._paint_timer is not None:
                self._paint_timer.stop()
            self._paint()
        elif self._paint_timer is None:
            self._paint_timer = self.set_timer(wait, self._paint)

    def repaint_hz(self) -> float:
        """Pane repaints per second while the model runs: --refresh HZ when given; else MAX_REFRESH_HZ while a
        core is spare (the load average leaves one free: many cores, or a model waiting on a GPU) and
        REFRESH_HZ (2) when painting would take CPU from the decode. Looked at once a second. O(1)."""
        if self.config.refresh_hz:
            return self.config.refresh_hz
        if REFRESH_HZ != SHIPPED_REFRESH_HZ:  # fixed by a benchmark
            return REFRESH_HZ
        now = time.monotonic()
        if now - self._hz_checked >= SPARE_CHECK_S:
            self._hz_checked = now
            spare = spare_cores()
            self._auto_hz = MAX_REFRESH_HZ if spare is not None and spare >= 1.0 else REFRESH_HZ
        return self._auto_hz

    def _paint(self) -> None:
        self._paint_timer = None
        self._last_paint = time.monotonic()
        snapshot = self.latest
        if snapshot is None or not self.is_running or self.app._exit or not self.query(TokenBufferPane):
            return  # a timer that fires during teardown has no panes left to paint
        if self.pinned_step is None:
            self._show(snapshot)
        self._show_chat()
        self.show_diagnostics()
        self._show_step_status(snapshot)
        self.update_title()  # running, paused, ended: the state may change with any step

    def _show_step_status(self, snapshot: StepSnapshot) -> None:
        """The status line: the source's text beside the step's numbers and the recent steps' rate."""
        recent = list(self._recent_ms)  # one C call: the engine reader thread appends
        speed = 1000 * len(recent) / sum(recent) if recent else None
        self.query_one(StatusBar).show(snapshot, self.model_text, speed)

    def on_session_state(self, message: SessionState) -> None:
        self.messages, self.diagnostics = message.messages, message.diagnostics
        record = message.record or {}
        self.driver.state(record)
        if record.get("error"):  # an exception in the engine: said as an alarm; the engine kept its session
            self.report_error(
                f"{record['done']}: {record['error']}",
                record["error"],
                SESSION_KEPT,
                "error in the engine (session kept)",
            )
        self._show_chat()
        self.show_diagnostics()
        self.update_title()
        if message.note:
            self.notify(message.note, severity=message.severity, timeout=6 if message.severity != "error" else 12)
        if not self.messages:  # reset (or rewound to nothing): no step's numbers or reuse stay on screen
            self.latest = None
            self._show(None)
            self._show_chat()
            self.query_one(StatusBar).show(None, self.model_text, None)

    def _show(self, snapshot: StepSnapshot | None) -> None:
        step = snapshot
        snapshot = self._show_requests(step, self.driver.shown(step))
        for pane in (TokenBufferPane, CursorPane, LayersPane, TopKPane):
            self.query_one(pane).show(snapshot)
        self._show_attention(snapshot)
        buffer_pane = self.query_one(TokenBufferPane)  # the selection may have moved (tail, rewind): O(1)
        index, shown = buffer_pane.selected_index, buffer_pane.snapshot
        token = None if index is None or shown is None or index >= len(shown.buffer) else shown.buffer[index]
        self.query_one(CursorPane).show_token(token)

    def _show_attention(self, snapshot: StepSnapshot | None) -> None:
        """The buffer shaded by the selected attention row, and the per-layer strip (--attention)."""
        layer, head = self.attention_view
        self.query_one(AttentionStrip).show(snapshot, layer, head)
        if snapshot is not None and snapshot.attention is not None:
            self.query_one(TokenBufferPane).attention = shading(snapshot, layer, head)

    def _show_requests(self, step: StepSnapshot | None, shown: StepSnapshot | None) -> StepSnapshot | None:
        """A packed forward (continuous batching): its requests listed, the step as the picked one saw it."""
        packed = step is not None and step.requests is not None
        if packed != self.packed:
            self.packed = packed
            self._apply_layout()
        pane = self.query_one(RequestsPane)
        pane.show(step, self.request_views.copy())
        shown, line = picked_request(step, shown, pane.selected_request, pane.palette)
        self.query_one(CursorPane).show_request(line)
        return shown

    def _show_chat(self) -> None:
        chat = self.query_one(ChatPane)
        snapshot = self.latest
        # a character the cache ends inside of: the last message ends on its first bytes
        unfinished = unfinished_tail(snapshot.buffer, snapshot.token_bytes) if snapshot is not None else b""
        chat.show_messages(self.messages, unfinished=unfinished)
        chat.show_reuse((self.driver.reuse_text(snapshot) if snapshot is not None else None) or "")

    def show_diagnostics(self, diagnostics: tuple[Diagnostic, ...] | None = None) -> None:
        """The source's alarms so far (None: those the app holds) with the app's own, in the diagnostics pane
        and the alarm line."""
        if diagnostics is not None:
            self.diagnostics = diagnostics
        merged = tuple(sorted(self.diagnostics + tuple(self.app_diagnostics), key=lambda d: d.step))
        pane = self.query_one(DiagnosticsPane)
        pane.show_diagnostics(merged)
        self.query_one(AlarmLine).show_groups(pane.groups)

    @on(TokenBufferPane.Selected)
    def token_selected(self, message: TokenBufferPane.Selected) -> None:
        """The selected token's whole piece, id, position and origin in the cursor pane."""
        self.query_one(CursorPane).show_token(message.token)

    def watch_step_mode(self) -> None:
        self.update_title()

    def update_title(self) -> None:
        """The sub-title, the status line's state badge and the chat pane's border title again, from the
        driver's `title()`: the state (mode, paused, following, ended) is always on screen, at any width."""
        self.sub_title, border = self.driver.title()
        try:
            self.query_one(ChatPane).border_title = border
            self.query_one(StatusBar).set_state(self.sub_title)
        except NoMatches:  # not composed yet: on_mount sets it
            pass

    def on_unmount(self) -> None:
        if self._paint_timer is not None:
            self._paint_timer.stop()

"""The Textual app: one viewer over three sources. Widgets render snapshots, nothing else.

The app takes its source as an argument (kvtui/drivers): kvtui's own chat in the engine process (the default),
a watched program, or a trace. The source's worker thread posts snapshots (`post_message` is thread-safe;
snapshots coalesce in run mode); keys become the source's commands, and a key the source cannot honour is
dimmed, with the reason in help and in the note a press gives. A source asks of the app only what
drivers/base.py `Viewer` lists; the app calls on it only what `Driver` declares.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Literal

from textual import events, on
from textual.app import App, ComposeResult
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.reactive import reactive
from textual.timer import Timer
from textual.widgets import Footer, Input
from textual.worker import Worker, WorkerState

from .drivers.base import Driver, ui_cpu
from .drivers.chat import HISTORY_STEPS, ChatDriver
from .engine.chat.remote import RemoteSession
from .engine.records.snapshot import Diagnostic, RequestView, StepSnapshot, VerifyResult
from .fmt import printable
from .keys import APP_KEYS
from .messages import Call, SessionState, SnapshotReady
from .options import AppConfig
from .themes import DEFAULT_THEME, load_themes
from .widgets.alarm_line import AlarmLine
from .widgets.attention_strip import AttentionStrip, shading
from .widgets.chat_pane import ChatPane
from .widgets.cursor_pane import CursorPane
from .widgets.diagnostics_pane import DiagnosticsPane
from .widgets.help_screen import HelpScreen
from .widgets.layers_pane import LayersPane
from .widgets.program_input import ProgramInput
from .widgets.requests_pane import RequestsPane, picked_request
from .widgets.status_bar import StatusBar
from .widgets.token_buffer import TokenBufferPane
from .widgets.topk_pane import TopKPane

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


__all__ = ["HISTORY_STEPS", "KvtuiApp", "SessionState", "SnapshotReady"]

KEPT_REQUEST_VIEWS = 256  # requests whose newest view the app remembers (the requests pane's departed rows)
PANES = ("buffer", "cursor", "topk", "layers", "diagnostics")
SESSION_KEPT = "the session is as it was before this action: go on, v verifies it, q quits"


def _ui_ms_since(before: float | None) -> float | None:
    after = ui_cpu()
    return None if before is None or after is None else (after - before) * 1000


def _load_note(ui_ms: float | None, measured_ms: float) -> str:
    """' (UI busy 120 ms meanwhile)' when the UI thread took a real share of the CPU during a timing."""
    if ui_ms is None or ui_ms < 20 or ui_ms < 0.1 * measured_ms:
        return ""
    return f" (UI busy {ui_ms:.0f} ms meanwhile)"


class KvtuiApp(App):
    TITLE = "kvtui"
    step_mode = reactive(False)  # Enter only prefills; space steps
    CSS_PATH = "app.tcss"
    BINDINGS = APP_KEYS  # keys.py: every key of the app, one table

    def __init__(
        self,
        config: AppConfig | None = None,
        *,
        source: Driver | None = None,
        loaded=None,
        clock=None,
        loader=None,
        engine_setup=None,
    ):
        """`config`: a ready AppConfig (the CLI builds and validates it). `source`: what the app shows (a
        TraceDriver, a ProgramDriver); none: kvtui's own chat on config.model, in the engine process, where
        these go and so must pickle: `loaded`, an already loaded model; `loader`, a function returning one
        (instead of loading config.model); `clock`, the session's clock; `engine_setup(session)`, called there
        once the session exists."""
        super().__init__()
        config = config or AppConfig()
        self.config = config
        self.script_turns = list(config.script.turns) if config.script else []
        self.driver: Driver = source or ChatDriver(
            config, loaded=loaded, clock=clock, loader=loader, engine_setup=engine_setup
        )
        self.driver.attach(self)
        for binding in self.driver.BINDINGS:  # the source's own keys replace the app's (this instance's map)
            for key in binding.key.split(","):
                self._bindings.key_to_bindings[key.strip()] = [replace(binding, key=key.strip())]
        self._ui_before_prefill: float | None = None
        self._ui_before_verify: float | None = None
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
        # each request's newest view, from every step given (painted or not): a request that left between two
        # repaints is listed as it ended, not as the last painted step saw it (written by a source's thread)
        self._request_views: OrderedDict[str, RequestView] = OrderedDict()
        self._request_views_lock = threading.Lock()
        self._last_paint = 0.0
        self._prefill: StepSnapshot | None = None  # this turn's prefill, for the reuse meter
        self._last_verify: VerifyResult | None = None
        # CPU the UI thread used while the prefill / the last verify ran: the two timings of the reuse
        # meter are only comparable when neither was slowed by the UI (on 2 cores it competes)
        self._prefill_ui_ms: float | None = None
        self._verify_ui_ms: float | None = None
        self._paint_timer: Timer | None = None
        self._auto_hz: float = REFRESH_HZ
        self._hz_checked = float("-inf")
        self._themes = load_themes()
        for theme in self._themes.values():
            self.register_theme(theme)
        theme = config.theme
        self.theme = theme if theme in self._themes or theme in self.available_themes else DEFAULT_THEME

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity="information",
        timeout: float | None = None,
        markup: bool = False,
    ) -> None:
        """Every notification shows its text literally: no markup, control characters escaped."""
        super().notify(
            printable(message, newlines=True), title=printable(title), severity=severity, timeout=timeout, markup=markup
        )

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
        self._apply_layout()
        self.query_one(ChatPane).input.focus()
        self.update_title()
        self.driver.start()

    def on_resize(self, event) -> None:
        self._apply_layout(event.size)

    def _apply_layout(self, size=None) -> None:
        """Reflow at every size: narrow terminals (< 110 columns) get a thinner chat, short ones (< 32 rows)
        fold the layers and diagnostics row (the cursor pane still shows every layer's K/V shape, the alarm
        line the top alarm) until F5 / F6 shows it; a terminal that grows unfolds it again."""
        width, height = size if size is not None else self.size
        self.screen.set_class(width < 110, "narrow")
        self.screen.set_class(height < 32, "short")
        self.screen.set_class(self.theme == "kvtui-projector", "roomy")
        hidden = self._hidden_panes(height)
        for name in PANES:
            self.query_one(f"#{name}").display = name not in hidden
        self.query_one("#row2").display = not ({"cursor", "topk"} <= hidden)
        self.query_one("#row3").display = not ({"layers", "diagnostics"} <= hidden)
        self.query_one(AlarmLine).display = "diagnostics" in hidden
        self.query_one(RequestsPane).display = self.packed and "requests" not in hidden

    def _hidden_panes(self, height: int | None = None) -> set[str]:
        height = self.size.height if height is None else height
        folded = {"layers", "diagnostics"} if height < 32 or self.theme == "kvtui-projector" else set()
        return self.hidden | (folded - self.shown)

    # ---- the source -------------------------------------------------------------------------------

    @classmethod
    def replay(cls, trace_path: Path, theme_name: str | None = None, *, follow: bool = False) -> KvtuiApp:
        """`kvtui replay [--follow] TRACE` (a TraceError, file:line, before any screen unless following)."""
        from .drivers.trace import TraceDriver

        config = AppConfig(theme=theme_name) if theme_name else AppConfig()
        return cls(config, source=TraceDriver(trace_path, follow=follow))

    @classmethod
    def watch(cls, target: str | None = None, args: list[str] | None = None, *, theme_name=None, **how) -> KvtuiApp:
        """`kvtui watch`: a program to start (`target`, `args`, module=...) or a started source=... (drivers/
        program.py ProgramDriver takes the rest)."""
        from .drivers.program import ProgramDriver

        config = AppConfig(theme=theme_name) if theme_name else AppConfig()
        return cls(config, source=ProgramDriver(target, args, **how))

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
        self.show_status(text if status is None else status)

    def show_status(self, text: str) -> None:
        """The status line says `text` until the next step repaints it (progress, a stopped engine)."""
        self.query_one(StatusBar).set_text(text)

    def record_step(self, snapshot: StepSnapshot) -> None:
        """A step's sparkline points and tok/s sample (decode steps only: a compiling step is not a slow one).
        Safe on a source's reader thread: deque appends, which the UI thread reads as copies when it paints."""
        self._status_bar.record(snapshot)
        if snapshot.requests:
            with self._request_views_lock:
                views = self._request_views
                for view in snapshot.requests:
                    views[view.request_id] = view
                    views.move_to_end(view.request_id)
                while len(views) > KEPT_REQUEST_VIEWS:
                    views.popitem(last=False)
        if snapshot.phase == "decode" and snapshot.compile_ms is None:
            self._recent_ms.append(snapshot.forward_ms + snapshot.snapshot_ms)

    def replay_step_history(self, snapshots: Sequence[StepSnapshot]) -> None:
        """The sparklines and the tok/s window hold these steps and no others."""
        self._status_bar.latency.clear()
        self._status_bar.cache_size.clear()
        self._recent_ms.clear()
        with self._request_views_lock:
            self._request_views.clear()
        for snapshot in snapshots:
            self.record_step(snapshot)

    def set_prefill(self, prefill: StepSnapshot | None) -> None:
        """This turn's prefill, which the reuse meter reads (a source that moves between turns says which)."""
        self._prefill = prefill

    def start_ui_timing(self, forward: Literal["prefill", "verify"], cpu: float | None) -> None:
        """A prefill or a verify was sent; `cpu`: the UI thread's CPU seconds now (None: not measured)."""
        if forward == "prefill":
            self._ui_before_prefill = cpu
        else:
            self._ui_before_verify = cpu

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
        if snapshot.phase == "prefill":
            self._prefill = snapshot
            if self._ui_before_prefill is not None:
                self._prefill_ui_ms, self._ui_before_prefill = _ui_ms_since(self._ui_before_prefill), None
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
        if snapshot is None or not self.is_running or self._exit or not self.query(TokenBufferPane):
            return  # a timer that fires during teardown has no panes left to paint
        if self.pinned_step is None:
            self._show(snapshot)
        self._show_chat()
        self.show_diagnostics()
        recent = list(self._recent_ms)  # one C call: the engine reader thread appends
        speed = 1000 * len(recent) / sum(recent) if recent else None
        self.query_one(StatusBar).show(snapshot, self.model_text, speed)

    def on_session_state(self, message: SessionState) -> None:
        self.messages, self.diagnostics = message.messages, message.diagnostics
        record = message.record or {}
        self.driver.state(record)
        if message.verify is not None:
            self._last_verify = message.verify
            if self._ui_before_verify is not None:
                self._verify_ui_ms, self._ui_before_verify = _ui_ms_since(self._ui_before_verify), None
        if record.get("error"):  # an exception in the engine: said as an alarm; the engine kept its session
            self.report_error(
                f"{record['done']}: {record['error']}",
                record["error"],
                SESSION_KEPT,
                "error in the engine (session kept)",
            )
        self._show_chat()
        self.show_diagnostics()
        if message.note:
            self.notify(message.note, severity=message.severity, timeout=6 if message.severity != "error" else 12)
        if not self.messages:
            self.latest = None
            self._show(None)

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

    def _show_requests(self, step: StepSnapshot | None, shown: StepSnapshot | None) -> StepSnapshot | None:
        """A packed forward (continuous batching): its requests listed, the step as the picked one saw it."""
        packed = step is not None and step.requests is not None
        if packed != self.packed:
            self.packed = packed
            self._apply_layout()
        pane = self.query_one(RequestsPane)
        with self._request_views_lock:
            latest = dict(self._request_views)
        pane.show(step, latest)
        shown, line = picked_request(step, shown, pane.selected_request, pane.palette)
        self.query_one(CursorPane).show_request(line)
        return shown

    def _show_chat(self) -> None:
        chat = self.query_one(ChatPane)
        chat.show_messages(self.messages)
        snapshot = self.latest
        if snapshot is not None:
            text = self.driver.reuse_text(snapshot)
            chat.show_reuse(text if text is not None else self._reuse_meter(snapshot))

    def _reuse_meter(self, snapshot: StepSnapshot) -> str:
        """The reuse meter: what this turn took from the cache, what it fed, what a re-encode would cost."""
        prefill = self._prefill
        if prefill is None or prefill.turn != snapshot.turn:
            return f"turn {snapshot.turn} · cache {snapshot.cache_seq_length} tokens · step {snapshot.step}"
        fed = len(prefill.input_ids)
        reused = len(prefill.buffer) - fed
        share = reused / len(prefill.buffer) if len(prefill.buffer) else 0.0
        text = (
            f"turn {snapshot.turn} · reused {reused} cached tokens, fed {fed} ({share:.0%} reuse) · "
            f"prefill {prefill.forward_ms:.0f} ms{_load_note(self._prefill_ui_ms, prefill.forward_ms)}"
        )
        verify = self._last_verify
        if verify is not None:
            text += (
                f" · full re-encode of {verify.tokens} tokens: {verify.ms:.0f} ms"
                f"{_load_note(self._verify_ui_ms, verify.ms)}"
            )
        else:
            text += " · v measures a full re-encode"
        return text

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

    # ---- user actions ----------------------------------------------------------------------------

    @on(Input.Submitted, "#message")
    def send_message(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text and self.script_turns:
            text = self.script_turns.pop(0)
        if not text:
            return
        event.input.value = ""
        self.pinned_step = None
        self.driver.command("send", text)
        self.query_one(TokenBufferPane).focus()
        self.show_next_script_turn()

    def action_next_script_turn(self) -> None:
        """Enter outside the input (the cache pane has the focus after a send): the script's next turn."""
        if not self.script_turns:
            return
        self.pinned_step = None
        self.driver.command("send", self.script_turns.pop(0))
        self.show_next_script_turn()

    def show_next_script_turn(self) -> None:
        """The input's placeholder: the script's next turn, or how to type a message."""
        placeholder = (
            f"Enter (here or in the cache pane) sends the script's next turn: {self.script_turns[0]}"
            if self.script_turns
            else "Type a message, Enter to send"
        )
        self.query_one(ChatPane).input.placeholder = placeholder

    # ---- keys a source cannot honour ------------------------------------------------------------------

    def unavailable(self, action: str) -> str | None:
        """Why `action` cannot run on this app's source (None: it can). Such a key is dimmed in the footer,
        its reason is listed in help, and pressing it says the reason and changes nothing."""
        return self.driver.unavailable(action)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        return None if self.unavailable(action) is not None else True  # None: shown disabled

    def on_key(self, event: events.Key) -> None:
        """Textual skips a disabled binding silently: a key pressed for one hears why instead."""
        if isinstance(self.focused, Input):  # typed text, not a key for the app
            return
        for binding in self._bindings.key_to_bindings.get(event.key, ()):
            why = self.unavailable(binding.action.partition("(")[0])
            if why is not None:
                event.stop()
                self.notify(why, severity="warning", timeout=4)
                return

    def action_focus_input(self) -> None:
        self.driver.focus_input()

    def action_step(self) -> None:
        self.driver.command("step")

    def action_run(self) -> None:
        self.driver.command("run")

    def action_pause(self) -> None:
        self.driver.pause()

    def action_stop(self) -> None:
        if isinstance(self.focused, Input):
            self.query_one(TokenBufferPane).focus()
            return
        if self.pinned_step is not None:
            self.action_live()
            return
        self.driver.stop_turn()

    def action_rewind(self) -> None:
        self.driver.command("rewind", 1)

    def action_rewind_to(self) -> None:
        index = self.query_one(TokenBufferPane).selected_index
        if index is None:
            self.notify("select a token in the buffer first (arrows or click)", severity="warning")
            return
        self.driver.command("rewind_to", index)

    def action_force(self) -> None:
        token_id = self.query_one(TopKPane).selected_token_id
        if token_id is None:
            self.notify("select a token in the top-k pane first", severity="warning")
            return
        self.driver.command("force", token_id)

    @on(TopKPane.Force)
    def force_from_pane(self, message: TopKPane.Force) -> None:
        self.driver.command("force", message.token_id)

    def action_verify(self) -> None:
        self.driver.command("verify")

    def action_export_cache(self) -> None:
        self.driver.command("export")

    def action_reset(self) -> None:
        self.driver.command("reset")

    def watch_step_mode(self) -> None:
        self.update_title()

    def action_toggle_step_mode(self) -> None:
        self.step_mode = not self.step_mode
        self.notify(
            "step mode: Enter prefills, space steps" if self.step_mode else "run mode: Enter runs the turn", timeout=3
        )

    def update_title(self) -> None:
        """The sub-title and the chat pane's border title again, from the driver's `title()`."""
        self.sub_title, border = self.driver.title()
        try:
            self.query_one(ChatPane).border_title = border
        except NoMatches:  # not composed yet: on_mount sets it
            pass

    def action_sampler(self) -> None:
        self.driver.sampler()

    @on(LayersPane.LayerSelected)
    def layer_selected(self, message: LayersPane.LayerSelected) -> None:
        self.query_one(TokenBufferPane).selected_layer = message.index
        self.driver.attention(message.index)
        shown = self.query_one(TokenBufferPane).snapshot
        if shown is not None and shown.attention is not None:
            self.attention_view = (message.index, None)
            self._show_attention(shown)

    def _show_attention(self, snapshot: StepSnapshot | None) -> None:
        """The buffer shaded by the selected attention row, and the per-layer strip (--attention)."""
        layer, head = self.attention_view
        self.query_one(AttentionStrip).show(snapshot, layer, head)
        if snapshot is not None and snapshot.attention is not None:
            self.query_one(TokenBufferPane).attention = shading(snapshot, layer, head)

    def action_attention_layer(self, delta: int) -> None:
        """[ / ]: all layers, then each layer with attention, in turn; the source keeps that layer's heads."""
        snapshot = self.query_one(TokenBufferPane).snapshot
        if snapshot is None or snapshot.attention is None:
            self.notify("no attention in these steps: start with --attention", severity="warning")
            return
        choices: list[int | None] = [None, *(i for i, e in enumerate(snapshot.attention) if e is not None)]
        layer = self.attention_view[0]
        at = choices.index(layer) if layer in choices else 0
        layer = choices[(at + delta) % len(choices)]
        self.attention_view = (layer, None)
        if layer is not None:
            self.driver.attention(layer)  # its heads from the next step
            self.query_one(TokenBufferPane).selected_layer = layer
        self._show_attention(snapshot)

    def action_attention_head(self, delta: int) -> None:
        """{ / }: the selected layer's head mean, then each of its heads."""
        snapshot = self.query_one(TokenBufferPane).snapshot
        layer, head = self.attention_view
        detail = snapshot.attention_detail if snapshot is not None else None
        if snapshot is None or detail is None or layer is None:
            self.notify("pick a layer first ([ / ])", severity="warning")
            return
        if detail.layer != layer:
            self.notify(f"the heads of layer {layer} arrive with the next step", timeout=3)
            return
        choices: list[int | None] = [None, *range(len(detail.heads))]
        at = choices.index(head) if head in choices else 0
        self.attention_view = (layer, choices[(at + delta) % len(choices)])
        self._show_attention(snapshot)

    def action_watch(self) -> None:
        token = self.query_one(TopKPane).selected_token
        if token is None:
            self.notify("select a token in the top-k pane first", severity="warning")
            return
        self.driver.watch(token)

    def action_restart_engine(self) -> None:
        self.driver.restart()

    # keys only some sources bind (their BINDINGS): the source does what they say (Driver: not available)
    def action_break_on_alarm(self) -> None:
        self.driver.toggle_break_on_alarm()

    def action_next_row(self) -> None:
        """n: the next request of a packed forward (continuous batching), else the source's next batch row."""
        if self.packed and self.query_one(RequestsPane).select_next() is not None:
            return
        self.driver.next_row()

    @on(RequestsPane.RequestSelected)
    def request_selected(self, message: RequestsPane.RequestSelected) -> None:
        """The cache, cursor and top-k panes show the picked request (at the step shown)."""
        step = self.latest if self.pinned_step is None else self.driver.find_step(self.pinned_step)
        self._show(step)

    def action_next_model(self) -> None:
        self.driver.next_model()

    # a program's stdin (drivers/program.py mounts the input line)
    @on(ProgramInput.Line)
    def send_line(self, message: ProgramInput.Line) -> None:
        self.driver.send_line(message.text)

    @on(ProgramInput.EndInput)
    def end_input(self) -> None:
        self.driver.end_input()

    @on(ProgramInput.Interrupt)
    def interrupt_program(self) -> None:
        self.driver.interrupt()

    @on(ProgramInput.Leave)
    def leave_input(self) -> None:
        self.query_one(TokenBufferPane).focus()

    @on(DiagnosticsPane.JumpTo)
    def jump_to(self, message: DiagnosticsPane.JumpTo) -> None:
        found = self.driver.find_step(message.step)
        if found is None:
            self.notify(
                f"step {message.step} is older than the last {HISTORY_STEPS} kept in memory (it is in the trace)",
                severity="warning",
            )
            return
        self.pinned_step = message.step
        self._show(found)
        self.notify(f"showing step {message.step}: press g (or Esc) to go back to the live step", timeout=5)

    def action_live(self) -> None:
        self.pinned_step = None
        self._show(self.latest)

    def action_toggle_pane(self, name: str) -> None:
        if name in self._hidden_panes():
            self.hidden.discard(name)
            self.shown.add(name)
        else:
            self.hidden.add(name)
            self.shown.discard(name)
        self._apply_layout()

    def action_help(self) -> None:
        own = {key.strip() for binding in self.driver.BINDINGS for key in binding.key.split(",")}
        kept = [b for b in self.BINDINGS if not own & {key.strip() for key in b.key.split(",")}]
        self.push_screen(HelpScreen([*self.driver.BINDINGS, *kept], self.unavailable))

    def action_next_theme(self) -> None:
        names = sorted(self._themes)
        self.theme = names[(names.index(self.theme) + 1) % len(names)] if self.theme in names else names[0]
        self._apply_layout()
        self.notify(f"theme: {self.theme}", timeout=2)

    def action_save_trace(self) -> None:
        self.driver.save_trace()

    def action_screenshot(self) -> None:
        path = self.save_screenshot()
        self.notify(f"screenshot saved to {path}", timeout=6)

    async def action_quit(self) -> None:
        """Quit at any moment: the source ends first (the engine finishes its forward and closes its trace; a
        watched program and whatever it started are stopped), then the app."""
        import asyncio

        await asyncio.to_thread(self.driver.stop)
        self.workers.cancel_node(self)
        self.exit()

    def on_unmount(self) -> None:
        if self._paint_timer is not None:
            self._paint_timer.stop()
        self.driver.stop()  # at once when it has ended already

"""The Textual app. Widgets render snapshots, nothing else.

The model runs in the engine process (engine/host.py), never in this interpreter: keys become
commands on its control pipe, and one thread worker (the pump, group "engine") reads its records,
rebuilds each step's snapshot and posts it (`post_message` is thread-safe; snapshots coalesce in
run mode). If the engine process dies, the app says so and R restarts it with the chat so far.
"""

from __future__ import annotations

import gc
import os
import shutil
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

from textual import events, on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.message import Message
from textual.reactive import reactive
from textual.widgets import Footer, Input
from textual.worker import Worker, WorkerState, get_current_worker

from .engine.remote import RemoteSession, diagnostics_from
from .engine.snapshot import Diagnostic, StepSnapshot, VerifyResult, buffer_record
from .fmt import printable
from .options import AppConfig
from .themes import DEFAULT_THEME, load_themes
from .widgets.alarm_line import AlarmLine
from .widgets.chat_pane import ChatPane
from .widgets.cursor_pane import CursorPane
from .widgets.diagnostics_pane import DiagnosticsPane
from .widgets.help_screen import HelpScreen
from .widgets.layers_pane import LayersPane
from .widgets.sampler_modal import SamplerModal
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


HISTORY_STEPS = 512  # snapshots kept for "jump to step"; older steps live in the trace on disk
PANES = ("buffer", "cursor", "topk", "layers", "diagnostics")
SESSION_KEPT = "the session is as it was before this action: go on, v verifies it, q quits"


# ---- messages from the workers (posted from threads) ---------------------------------------------


@dataclass
class SnapshotReady(Message):
    snapshot: StepSnapshot
    messages: list[dict] | None  # None while running between repaints: decoding the reply is O(reply)
    diagnostics: tuple[Diagnostic, ...]
    running: bool
    facts: dict | None = None  # the engine's `session` record just before this step (steps, turn, cache length)
    recorded: bool = False  # its sparkline point and tok/s sample are counted already (own chat, replay)

    def can_replace(self, message: Message) -> bool:
        # In run mode only the newest decode snapshot matters: it carries everything a pane needs.
        # A prefill is kept (the reuse meter reads what it fed), and so is a step that raised an
        # alarm (the diagnostics pane jumps to it).
        # Textual asks the queued (older) message whether the next one may supersede it.
        return isinstance(message, SnapshotReady) and self.snapshot.phase == "decode" and not self.snapshot.diagnostics


@dataclass
class SessionState(Message):
    """Non-step changes: rewinds to empty, resets, verify results, refusals; the engine's `state` record
    after each command (`record`: its facts, None for sources that have none)."""

    messages: list[dict]
    diagnostics: tuple[Diagnostic, ...]
    note: str = ""
    severity: str = "information"
    verify: VerifyResult | None = None
    record: dict | None = None


@dataclass
class ModelReady(Message):
    record: dict  # the engine's `ready` record


@dataclass
class EngineExited(Message):
    """The engine process ended without being asked to (an exception, an out-of-memory kill)."""

    error: str


@dataclass
class LoadProgress(Message):
    text: str
    fraction: float | None


@dataclass
class LoadFailed(Message):
    error: str


def _ui_cpu() -> float | None:
    """CPU seconds the UI (main) thread has used so far; None where the OS cannot tell."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(threading.main_thread().ident))
    except (AttributeError, OSError, TypeError):
        return None


def _ui_ms_since(before: float | None) -> float | None:
    after = _ui_cpu()
    return None if before is None or after is None else (after - before) * 1000


def _load_note(ui_ms: float | None, measured_ms: float) -> str:
    """' (UI busy 120 ms meanwhile)' when the UI thread took a real share of the CPU during a timing."""
    if ui_ms is None or ui_ms < 20 or ui_ms < 0.1 * measured_ms:
        return ""
    return f" (UI busy {ui_ms:.0f} ms meanwhile)"


def _verify_result(state: dict) -> VerifyResult | None:
    verify = state.get("verify")
    if not verify:
        return None
    return VerifyResult(
        **{**verify, "cached_top": tuple(verify["cached_top"]), "recomputed_top": tuple(verify["recomputed_top"])}
    )


def _exit_reason(code: int | None, stderr: deque) -> str:
    """Why the engine process ended, in one line: the signal (an out-of-memory kill is SIGKILL) or its error."""
    import signal

    last = next((line for line in reversed(stderr) if line.strip()), "")
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        oom = " (the out-of-memory killer sends this)" if name == "SIGKILL" else ""
        return f"killed by {name}{oom}" + (f": {last}" if last else "")
    return f"exited with code {code}" + (f": {last}" if last else "")


class KvtuiApp(App):
    TITLE = "kvtui"
    step_mode = reactive(False)  # Enter only prefills; space steps
    CSS_PATH = "app.tcss"
    BINDINGS = [
        Binding(
            "f5", "toggle_pane('layers')", "layers", tooltip="show/hide the layers pane (folded on short terminals)"
        ),
        Binding(
            "f6",
            "toggle_pane('diagnostics')",
            "alarms",
            tooltip="show/hide the diagnostics pane (folded on short terminals: the alarm line shows the top alarm)",
        ),
        Binding("space,s", "step", "step"),
        Binding("r", "run", "run"),
        Binding("p", "pause", "pause"),
        Binding("escape", "stop", "stop turn", show=False),
        Binding("u", "rewind", "rewind 1"),
        Binding("backspace", "rewind_to", "rewind to selected", show=False),
        Binding("f", "force", "force selected top-k", show=False),
        Binding("v", "verify", "verify"),
        Binding("w", "watch", "watch the selected top-k token", show=False),
        Binding("m", "toggle_step_mode", "step mode"),
        Binding("o", "sampler", "sampler"),
        Binding("i", "focus_input", "type", show=False),
        Binding("enter", "next_script_turn", "send the script's next turn", show=False),
        Binding("g", "live", "back to live step", show=False),
        Binding("X", "reset", "reset cache and chat", show=False),
        Binding("R", "restart_engine", "restart a stopped engine (replays the chat)", show=False),
        Binding("ctrl+s", "save_trace", "save trace"),
        Binding("e", "export_cache", "export the cache (safetensors)", show=False),
        Binding("f12", "screenshot", "screenshot (SVG)", show=False),
        Binding("t", "next_theme", "theme", show=False),
        Binding("f2", "toggle_pane('buffer')", "show/hide token buffer", show=False),
        Binding("f3", "toggle_pane('cursor')", "show/hide cursor", show=False),
        Binding("f4", "toggle_pane('topk')", "show/hide top-k", show=False),
        Binding("question_mark,f1", "help", "help"),
        Binding("q,ctrl+q", "quit", "quit", priority=False),
    ]

    # Actions this app's source cannot do, with why (kvtui's own chat can do them all; a replay or a watched
    # program cannot rewind, force, ...). See unavailable().
    UNAVAILABLE: dict[str, str] = {}

    def __init__(self, config: AppConfig | None = None, *, loaded=None, clock=None, loader=None, engine_setup=None):
        """`config`: a ready AppConfig (the CLI builds and validates it). The rest go to the engine process
        and must pickle: `loaded`, an already loaded model; `loader`, a function returning one (instead of
        loading config.model); `clock`, the session's clock; `engine_setup(session)`, called there once
        the session exists."""
        super().__init__()
        config = config or AppConfig()
        self.config = config
        self.model_name = config.model
        self.options = config.options
        self.script_turns = list(config.script.turns) if config.script else []
        self.trace_path = config.trace_path
        self.verify_every = config.verify_every
        self._queued: str | None = None  # a message sent before the model was ready: sent once it is
        self._load_failed = False
        self._engine_objects = dict(loaded=loaded, loader=loader, clock=clock, engine_setup=engine_setup)
        self._clock = clock
        self.session: RemoteSession | None = None  # the engine's session as its records say; None until ready
        self.source = None  # the engine process (engine/host.py EngineSource)
        self._builder = None  # step records -> snapshots; kept across engine restarts (the buffer goes on)
        self._pending = 0  # commands sent to the engine and not answered yet
        self._engine_dead: str | None = None  # why the engine process ended, until R restarts it
        self._quitting = False
        self._ui_before_prefill: float | None = None
        self._ui_before_verify: float | None = None
        self.latest: StepSnapshot | None = None
        self.history: deque[StepSnapshot] = deque(maxlen=HISTORY_STEPS)  # the own chat's newest steps, all
        self.pinned_step: int | None = None
        self.diagnostics: tuple[Diagnostic, ...] = ()
        self.app_diagnostics: list[Diagnostic] = []  # worker errors: the engine never saw them
        self.messages: list[dict] = []
        self.model_text = "loading model…"
        self.hidden: set[str] = set()  # panes the user hid
        self.shown: set[str] = set()  # panes the user showed although the layout folds them
        self._recent_ms: deque[float] = deque(maxlen=16)
        self._last_paint = 0.0
        self._prefill: StepSnapshot | None = None  # this turn's prefill, for the reuse meter
        self._last_verify: VerifyResult | None = None
        # CPU the UI thread used while the prefill / the last verify ran: the two timings of the reuse
        # meter are only comparable when neither was slowed by the UI (on 2 cores it competes)
        self._prefill_ui_ms: float | None = None
        self._verify_ui_ms: float | None = None
        self._paint_timer = None
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
                yield TokenBufferPane(id="buffer")
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
        self._status_bar = self.query_one(StatusBar)  # for the engine reader thread (pump): no DOM query there
        self._apply_layout()
        self.query_one(ChatPane).input.focus()
        self._update_title()
        self.load_worker()

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

    def _hidden_panes(self, height: int | None = None) -> set[str]:
        height = self.size.height if height is None else height
        folded = {"layers", "diagnostics"} if height < 32 or self.theme == "kvtui-projector" else set()
        return self.hidden | (folded - self.shown)

    # ---- the engine process -------------------------------------------------------------------------

    def load_worker(self) -> None:
        """Start the engine process; it loads the model and streams its progress."""
        self.pump()

    @property
    def engine_busy(self) -> bool:
        """A command is still running in the engine (or on its way there)."""
        return self._pending > 0

    @work(thread=True, exclusive=True, exit_on_error=False, group="engine")
    def pump(self, restore: dict | None = None) -> None:
        """Start the engine process and turn its records into messages, until it ends."""
        from .engine.host import EngineSetup, EngineSource
        from .engine.replay import SnapshotBuilder
        from .engine.stream import ListCopy

        worker = get_current_worker()
        try:
            if self.source is None:
                trace = str(self.trace_path) if self.trace_path is not None else None  # None: the source spools
                setup = EngineSetup(self.model_name, self.options, trace, self.verify_every, **self._engine_objects)
                source = EngineSource(setup)
            else:  # R after the engine died: the next process appends to the same trace
                source = self.source.restarted(restore)
        except Exception as exc:  # noqa: BLE001  a model object that neither pickles nor saves, a full disk
            self.post_message(
                LoadFailed(f"could not hand the model to the engine process: {type(exc).__name__}: {exc}")
            )
            return
        self.source = source
        if self._builder is None:
            self._builder = SnapshotBuilder("engine")
        builder = self._builder
        diagnostics: tuple[Diagnostic, ...] = ()
        messages = facts = None
        chat, alarms = ListCopy(), ListCopy()  # the engine sends both as what changed
        errors: deque[str] = deque(maxlen=20)
        failed = False
        for record in source.records(stop=worker.cancelled_event):
            kind = record.get("type")
            if kind == "session":
                facts = record
                messages = chat.update(record, "messages")
                if alarms.update(record, "diagnostics") is not None:
                    diagnostics = diagnostics_from(alarms.items)
            elif kind == "step":
                snapshot = builder.add(record)
                self.history.append(snapshot)  # every step, here: a repaint may coalesce the messages below
                self._status_bar.record(snapshot)  # deque appends; the UI thread reads copies when it paints
                self._time_step(snapshot)
                self.post_message(
                    SnapshotReady(
                        snapshot, messages, diagnostics, bool(facts and facts["running"]), facts, recorded=True
                    )
                )
                messages = facts = None
            elif kind == "state":
                chat.update(record, "messages")
                alarms.update(record, "diagnostics")
                diagnostics = diagnostics_from(alarms.items)
                self.post_message(
                    SessionState(
                        chat.items,
                        diagnostics,
                        record.get("note", ""),
                        record.get("severity", "information"),
                        _verify_result(record),
                        record,
                    )
                )
            elif kind == "progress":
                self.post_message(LoadProgress(record["text"], record.get("fraction")))
            elif kind == "ready":
                self.post_message(ModelReady(record))
            elif kind == "load-failed":
                failed = True
                self.post_message(LoadFailed(record["error"]))
            elif kind == "output" and record["stream"] == "stderr" and record["text"].strip():
                errors.append(record["text"])
            elif kind == "process-exit" and not failed and not self._quitting:
                self.post_message(EngineExited(_exit_reason(record["code"], errors)))

    def on_load_progress(self, message: LoadProgress) -> None:
        share = f" {message.fraction:.0%}" if message.fraction is not None else ""
        self.query_one(StatusBar).set_text(f"⏳ {message.text}{share}")

    def on_model_ready(self, message: ModelReady) -> None:
        restarted = self._engine_dead is not None
        self._engine_dead = None
        self.session = RemoteSession(message.record)
        if self.latest is not None:
            self.session.buffer = self.latest.buffer
        self.model_text = self.session.description
        self.query_one(StatusBar).set_text(self.model_text)
        self.query_one(LayersPane).set_model_info(self.session.query_heads, self.session.kv_heads)
        # What exists now (Textual, the panes, a `loaded=` model) lives as long as the app: out of the cyclic
        # collector's scans, whose full passes over it would take CPU from the engine while it runs.
        gc.collect()
        gc.freeze()
        if restarted:
            return  # the restore command was queued with the start: its state says what happened
        self._show_next_script_turn()
        if self._queued is not None:  # typed while the model loaded: send it now
            text, self._queued = self._queued, None
            self.notify(f"model ready: sending {text!r}", timeout=3)
            self._engine("send", text)
        else:
            self.notify("model ready: type a message and press Enter", timeout=3)

    def on_load_failed(self, message: LoadFailed) -> None:
        self._load_failed = True
        self._pending = 0  # a restore queued with a restart that could not load
        if self._queued is not None:
            self.notify(f"not sent (no model): {self._queued!r}", severity="warning", timeout=10)
            self._queued = None
        self.model_text = f"no model: {message.error}"
        self.query_one(StatusBar).set_text(f"✗ {message.error}")
        self.notify(
            f"{message.error}\nq quits; fix the model or the options and start kvtui again",
            title="model not loaded",
            severity="error",
            timeout=30,
        )

    def on_engine_exited(self, message: EngineExited) -> None:
        self._engine_dead = message.error
        self._pending = 0
        self.query_one(StatusBar).set_text(f"✗ engine stopped: {message.error} · R restarts it")
        self._worker_error(
            f"engine process: {message.error}",
            message.error,
            "R restarts the engine and replays the chat so far into a fresh cache; q quits",
            "the engine process died",
            timeout=30,
        )

    def action_restart_engine(self) -> None:
        """R: a fresh engine process; the chat so far is fed into its new cache in one forward."""
        if self._engine_dead is None:
            self.notify("the engine is running: R restarts it only after it stopped", timeout=3)
            return
        restore = None
        if self.session is not None:
            tokens = self.latest.buffer if self.latest is not None else ()
            restore = {"tokens": buffer_record(tokens)["tokens"], "state": self.session.restorable}
        self.session = None
        self._pending = 1 if restore else 0
        self.query_one(StatusBar).set_text("⏳ restarting the engine")
        self.pump(restore)

    # ---- engine commands ---------------------------------------------------------------------------

    def _engine(self, action: str, argument=None) -> None:
        if self.session is None and action == "send" and not self._load_failed and self._engine_dead is None:
            replaced = " (replaces the one queued before)" if self._queued is not None else ""
            self._queued = argument
            self.notify(f"queued {argument!r}{replaced}: it is sent when the model is ready", timeout=4)
            return
        if self._engine_dead is not None:
            self.notify(f"the engine process stopped ({self._engine_dead}): R restarts it", severity="warning")
            return
        if self.session is None:
            self.notify(
                "the model is not loaded yet" if "✗" not in self.model_text else self.model_text, severity="warning"
            )
            return
        run = not self.step_mode
        if action == "send":
            self._ui_before_prefill = self._ui_cpu_now()
            argument = {"text": argument, "run": run}
        elif action == "force":
            argument = {"id": argument, "run": run}
        elif action == "sampler":
            argument = asdict(argument)
        elif action == "verify":
            self._ui_before_verify = self._ui_cpu_now()
        self._pending += 1
        self.source.command(action, argument)

    def _ui_cpu_now(self) -> float | None:
        # with an injected clock (tests, screenshots) every timing is fake: no real load note either
        return None if self._clock is not None else _ui_cpu()

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.state == WorkerState.ERROR:
            error = event.worker.error
            text = f"{type(error).__name__}: {error}"
            self._worker_error(
                f"{event.worker.name}: {text}", text, SESSION_KEPT, "error in the model worker (session kept)"
            )

    def _worker_error(self, alarm: str, text: str, next_steps: str, title: str, timeout: float = 10) -> None:
        """A `worker-error` alarm at the live step (the engine never saw it), and a notification saying what next."""
        step = self.latest.step if self.latest else 0
        self.app_diagnostics.append(Diagnostic("worker-error", "error", alarm, step))
        self._show_diagnostics()
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
            self._time_step(snapshot)
            self.query_one(StatusBar).record(snapshot)
        # Repaint at most repaint_hz times a second: on 2 busy cores every repaint takes CPU from the engine process.
        wait = self._last_paint + 1 / self.repaint_hz() - time.monotonic()
        if wait <= 0 or not message.running:  # single steps paint at once
            if self._paint_timer is not None:
                self._paint_timer.stop()
            self._paint()
        elif self._paint_timer is None:
            self._paint_timer = self.set_timer(wait, self._paint)

    def _time_step(self, snapshot: StepSnapshot) -> None:
        """The tok/s window: decode steps only (a compiling step is not a slow step)."""
        if snapshot.phase == "decode" and snapshot.compile_ms is None:
            self._recent_ms.append(snapshot.forward_ms + snapshot.snapshot_ms)

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
            buffer_pane = self.query_one(TokenBufferPane)
            if snapshot.attention is not None:
                peak = max(snapshot.attention) or 1.0
                buffer_pane.attention = [w / peak for w in snapshot.attention]
        self._show_chat()
        self._show_diagnostics()
        recent = list(self._recent_ms)  # one C call: the engine reader thread appends
        speed = 1000 * len(recent) / sum(recent) if recent else None
        self.query_one(StatusBar).show(snapshot, self.model_text, speed)

    def on_session_state(self, message: SessionState) -> None:
        self.messages, self.diagnostics = message.messages, message.diagnostics
        record = message.record or {}
        if record.get("done"):
            self._pending = max(0, self._pending - 1)
        if self.session is not None and record:
            self.session.update(record)
        if message.verify is not None:
            self._last_verify = message.verify
            if self._ui_before_verify is not None:
                self._verify_ui_ms, self._ui_before_verify = _ui_ms_since(self._ui_before_verify), None
        if record.get("error"):  # an exception in the engine: said as an alarm; the engine kept its session
            self._worker_error(
                f"{record['done']}: {record['error']}",
                record["error"],
                SESSION_KEPT,
                "error in the engine (session kept)",
            )
        self._show_chat()
        self._show_diagnostics()
        if message.note:
            self.notify(message.note, severity=message.severity, timeout=6 if message.severity != "error" else 12)
        if not self.messages:
            self.latest = None
            self._show(None)

    def _show(self, snapshot: StepSnapshot | None) -> None:
        for pane in (TokenBufferPane, CursorPane, LayersPane, TopKPane):
            self.query_one(pane).show(snapshot)
        buffer_pane = self.query_one(TokenBufferPane)  # the selection may have moved (tail, rewind): O(1)
        index, shown = buffer_pane.selected_index, buffer_pane.snapshot
        token = None if index is None or shown is None or index >= len(shown.buffer) else shown.buffer[index]
        self.query_one(CursorPane).show_token(token)

    def _show_chat(self) -> None:
        chat = self.query_one(ChatPane)
        chat.show_messages(self.messages)
        snapshot = self.latest
        if snapshot is not None:
            chat.show_reuse(self._reuse_text(snapshot))

    def _reuse_text(self, snapshot: StepSnapshot) -> str:
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

    def _show_diagnostics(self) -> None:
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
        self._engine("send", text)
        self.query_one(TokenBufferPane).focus()
        self._show_next_script_turn()

    def action_next_script_turn(self) -> None:
        """Enter outside the input (the cache pane has the focus after a send): the script's next turn."""
        if not self.script_turns:
            return
        self.pinned_step = None
        self._engine("send", self.script_turns.pop(0))
        self._show_next_script_turn()

    def _show_next_script_turn(self) -> None:
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
        return self.UNAVAILABLE.get(action)

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
        self.query_one(ChatPane).input.focus()

    def action_step(self) -> None:
        self._engine("step")

    def action_run(self) -> None:
        self._engine("run")

    def action_pause(self) -> None:
        if self.source is not None:
            self.source.command("pause")  # answered by the engine's control thread, mid-turn

    def action_stop(self) -> None:
        if isinstance(self.focused, Input):
            self.query_one(TokenBufferPane).focus()
            return
        if self.pinned_step is not None:
            self.action_live()
            return
        self.action_pause()

    def action_rewind(self) -> None:
        self._engine("rewind", 1)

    def action_rewind_to(self) -> None:
        index = self.query_one(TokenBufferPane).selected_index
        if index is None:
            self.notify("select a token in the buffer first (arrows or click)", severity="warning")
            return
        self._engine("rewind_to", index)

    def action_force(self) -> None:
        token_id = self.query_one(TopKPane).selected_token_id
        if token_id is None:
            self.notify("select a token in the top-k pane first", severity="warning")
            return
        self._engine("force", token_id)

    @on(TopKPane.Force)
    def force_from_pane(self, message: TopKPane.Force) -> None:
        self._engine("force", message.token_id)

    def action_verify(self) -> None:
        self._engine("verify")

    def action_export_cache(self) -> None:
        self._engine("export")

    def action_reset(self) -> None:
        self._engine("reset")

    def watch_step_mode(self) -> None:
        self._update_title()

    def action_toggle_step_mode(self) -> None:
        self.step_mode = not self.step_mode
        self.notify(
            "step mode: Enter prefills, space steps" if self.step_mode else "run mode: Enter runs the turn", timeout=3
        )

    def _update_title(self) -> None:
        self.sub_title = "step mode" if self.step_mode else "run mode"
        try:
            self.query_one(ChatPane).border_title = f"{self.title} · {self.sub_title}"
        except NoMatches:  # not composed yet: on_mount sets it
            pass

    def action_sampler(self) -> None:
        if self.session is None:
            self.notify("the model is not loaded yet", severity="warning")
            return

        def apply(settings) -> None:
            if settings is not None:
                self._engine("sampler", settings)

        self.push_screen(SamplerModal(self.session.sampler), apply)

    @on(LayersPane.LayerSelected)
    def layer_selected(self, message: LayersPane.LayerSelected) -> None:
        self.query_one(TokenBufferPane).selected_layer = message.index
        if self.session is not None:
            self.source.command("attention", message.index)  # an int swap there, read at the next forward

    def action_watch(self) -> None:
        token = self.query_one(TopKPane).selected_token
        if token is None or self.session is None:
            self.notify("select a token in the top-k pane first", severity="warning")
            return
        self.source.command("watch", token.id)  # a tuple swap there, between two forwards; recorded
        self.notify(f"watching {token.text!r} (id {token.id}): its rank shows in top-k from the next step", timeout=4)

    @on(DiagnosticsPane.JumpTo)
    def jump_to(self, message: DiagnosticsPane.JumpTo) -> None:
        found = self._find_step(message.step)
        if found is None:
            self.notify(
                f"step {message.step} is older than the last {HISTORY_STEPS} kept in memory (it is in the trace)",
                severity="warning",
            )
            return
        self.pinned_step = message.step
        self._show(found)
        self.notify(f"showing step {message.step}: press g (or Esc) to go back to the live step", timeout=5)

    def _find_step(self, step: int) -> StepSnapshot | None:
        return next((s for s in list(self.history) if s.step == step), None)  # list(): one C call, the pump appends

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
        self.push_screen(HelpScreen(self.BINDINGS, self.unavailable))

    def action_next_theme(self) -> None:
        names = sorted(self._themes)
        self.theme = names[(names.index(self.theme) + 1) % len(names)] if self.theme in names else names[0]
        self._apply_layout()
        self.notify(f"theme: {self.theme}", timeout=2)

    def action_save_trace(self) -> None:
        if self.session is None and self.latest is None:
            self.notify("nothing recorded yet", severity="warning")
            return
        if self.trace_path is not None:
            self.notify(f"the trace is being written to {self.trace_path}", timeout=5)
            return
        target = Path.cwd() / f"kvtui-trace-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
        try:
            partial = target.with_suffix(".jsonl.part")
            shutil.copyfile(self.source.trace_path, partial)
            os.replace(partial, target)  # never a half-written trace under the real name
        except OSError as exc:
            self.notify(f"could not save the trace to {target}: {exc}", severity="error")
            return
        self.notify(f"trace saved to {target}", timeout=6)

    def action_screenshot(self) -> None:
        path = self.save_screenshot()
        self.notify(f"screenshot saved to {path}", timeout=6)

    async def action_quit(self) -> None:
        """Quit at any moment: the engine finishes its forward, closes the trace and exits, then the app."""
        import asyncio

        self._quitting = True
        if self.source is not None:
            await asyncio.to_thread(self.source.stop)
        self.workers.cancel_group(self, "engine")
        self.exit()

    def on_unmount(self) -> None:
        self._quitting = True
        if self._paint_timer is not None:
            self._paint_timer.stop()
        if self.source is not None:
            self.source.stop()  # at once when it is gone already; else it closes its trace first; its files go

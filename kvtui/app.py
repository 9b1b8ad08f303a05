"""The Textual app: the only place with the generation worker. Widgets render snapshots, nothing else.

Threads: the model loads and every engine action runs in one exclusive thread worker (group
"engine"); a lock keeps a cancelled worker and its successor from touching the session at once.
Workers talk to the UI only through `post_message` (thread-safe); snapshots coalesce in run mode.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.message import Message
from textual.reactive import reactive
from textual.widgets import Footer, Input
from textual.worker import Worker, WorkerState, get_current_worker

from .engine.snapshot import Diagnostic, StepSnapshot, VerifyResult
from .fmt import printable
from .options import AppConfig, build_session_config, load
from .themes import DEFAULT_THEME, load_themes
from .widgets.chat_pane import ChatPane
from .widgets.cursor_pane import CursorPane
from .widgets.diagnostics_pane import DiagnosticsPane
from .widgets.help_screen import HelpScreen
from .widgets.layers_pane import LayersPane
from .widgets.sampler_modal import SamplerModal
from .widgets.status_bar import StatusBar
from .widgets.token_buffer import TokenBufferPane
from .widgets.topk_pane import TopKPane

REFRESH_HZ = 2  # pane repaints per second at most while the model runs: on 2 cores each repaint holds the GIL the model needs
HISTORY_STEPS = 512  # snapshots kept for "jump to step"; older steps live in the trace on disk
PANES = ("buffer", "cursor", "topk", "layers", "diagnostics")


# ---- messages from the workers (posted from threads) ---------------------------------------------


@dataclass
class SnapshotReady(Message):
    snapshot: StepSnapshot
    messages: list[dict] | None  # None while running between repaints: decoding the reply is O(reply)
    diagnostics: tuple[Diagnostic, ...]
    running: bool

    def can_replace(self, message: Message) -> bool:
        # In run mode only the newest decode snapshot matters: it carries everything a pane needs.
        # A prefill is kept (the reuse meter reads what it fed), and so is a step that raised an
        # alarm (the diagnostics pane jumps to it).
        # Textual asks the queued (older) message whether the next one may supersede it.
        return (isinstance(message, SnapshotReady) and self.snapshot.phase == "decode"
                and not self.snapshot.diagnostics)


@dataclass
class SessionState(Message):
    """Non-step changes: rewinds to empty, resets, verify results, refusals."""

    messages: list[dict]
    diagnostics: tuple[Diagnostic, ...]
    note: str = ""
    severity: str = "information"
    verify: VerifyResult | None = None


@dataclass
class ModelReady(Message):
    description: str
    query_heads: int | None
    kv_heads: int | None


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


class KvtuiApp(App):
    TITLE = "kvtui"
    step_mode = reactive(False)  # Enter only prefills; space steps
    CSS_PATH = "app.tcss"
    BINDINGS = [
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
        Binding("ctrl+s", "save_trace", "save trace"),
        Binding("e", "export_cache", "export the cache (safetensors)", show=False),
        Binding("f12", "screenshot", "screenshot (SVG)", show=False),
        Binding("t", "next_theme", "theme", show=False),
        Binding("f2", "toggle_pane('buffer')", "show/hide token buffer", show=False),
        Binding("f3", "toggle_pane('cursor')", "show/hide cursor", show=False),
        Binding("f4", "toggle_pane('topk')", "show/hide top-k", show=False),
        Binding("f5", "toggle_pane('layers')", "show/hide layers", show=False),
        Binding("f6", "toggle_pane('diagnostics')", "show/hide diagnostics", show=False),
        Binding("question_mark,f1", "help", "help"),
        Binding("q,ctrl+q", "quit", "quit", priority=False),
    ]

    def __init__(self, config: AppConfig | None = None, *, loaded=None, clock=None):
        """`config`: a ready AppConfig (the CLI builds and validates it); `loaded`: an already loaded model."""
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
        self._preloaded = loaded
        self._clock = clock
        self.session = None  # touched only inside engine workers (under _engine_lock)
        self._engine_lock = threading.Lock()
        self._recorder = None  # the engine's one trace writer, beside the session
        self._spool: Path | None = None
        self.running = False
        self.latest: StepSnapshot | None = None
        self.history: deque[StepSnapshot] = deque(maxlen=HISTORY_STEPS)
        self.pinned_step: int | None = None
        self.diagnostics: tuple[Diagnostic, ...] = ()
        self.app_diagnostics: list[Diagnostic] = []  # worker errors: the engine never saw them
        self.messages: list[dict] = []
        self.model_text = "loading model…"
        self.hidden: set[str] = set()  # panes the user hid
        self.shown: set[str] = set()  # panes the user showed although the layout folds them
        self._recent_ms: deque[float] = deque(maxlen=16)
        self._last_paint = 0.0
        self._messages_at = 0.0  # worker thread: when the transcript was last decoded
        self._prefill: StepSnapshot | None = None  # this turn's prefill, for the reuse meter
        self._last_verify: VerifyResult | None = None
        # CPU the UI thread used while the prefill / the last verify ran: the two timings of the reuse
        # meter are only comparable when neither was slowed by the UI (on 2 cores it competes)
        self._prefill_ui_ms: float | None = None
        self._verify_ui_ms: float | None = None
        self._paint_timer = None
        self._themes = load_themes()
        for theme in self._themes.values():
            self.register_theme(theme)
        theme = config.theme
        self.theme = theme if theme in self._themes or theme in self.available_themes else DEFAULT_THEME

    def notify(self, message: str, *, title: str = "", severity="information", timeout: float | None = None,
               markup: bool = False) -> None:
        """Every notification shows its text literally: no markup, control characters escaped."""
        super().notify(printable(message, newlines=True), title=printable(title), severity=severity,
                       timeout=timeout, markup=markup)

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
        yield StatusBar(id="status")
        yield Footer()

    def on_mount(self) -> None:
        self._apply_layout()
        self.query_one(ChatPane).input.focus()
        self._update_title()
        self.load_worker()

    def on_resize(self) -> None:
        self._apply_layout()

    def _apply_layout(self) -> None:
        """Reflow: short terminals fold the lower row away unless the user shows it (F5 / F6)."""
        width, height = self.size
        self.screen.set_class(width < 110, "narrow")
        self.screen.set_class(height < 32, "short")
        self.screen.set_class(self.theme == "kvtui-projector", "roomy")
        hidden = self._hidden_panes()
        for name in PANES:
            self.query_one(f"#{name}").display = name not in hidden
        self.query_one("#row2").display = not ({"cursor", "topk"} <= hidden)
        self.query_one("#row3").display = not ({"layers", "diagnostics"} <= hidden)

    def _hidden_panes(self) -> set[str]:
        folded = {"layers", "diagnostics"} if self.size.height < 32 or self.theme == "kvtui-projector" else set()
        return self.hidden | (folded - self.shown)

    # ---- loading -----------------------------------------------------------------------------------

    @work(thread=True, exclusive=True, exit_on_error=False, group="load")
    def load_worker(self) -> None:
        from .engine import introspect
        from .engine.loader import ModelLoadError
        from .engine.recorder import Recorder
        from .engine.session import ChatSession, SessionError
        from .engine.trace import TraceError

        try:
            loaded = self._preloaded or load(
                self.model_name, self.options,
                progress=lambda text, fraction=None: self.post_message(LoadProgress(text, fraction)))
            config = build_session_config(self.options, loaded.tokenizer)
            with self._engine_lock:
                extra = {"clock": self._clock} if self._clock else {}
                self.session = ChatSession(loaded.model, loaded.tokenizer, config, on_snapshot=self._on_engine_snapshot,
                                           **extra)
                if self.trace_path is None:
                    fd, spool = tempfile.mkstemp(prefix="kvtui-", suffix=".jsonl")
                    os.close(fd)
                    self._spool = Path(spool)
                self._recorder = Recorder(self.session, self.trace_path or self._spool, model_source=loaded.source,
                                          model_path=loaded.path, verify_every=self.verify_every)
        except (ModelLoadError, SessionError, TraceError, ValueError) as exc:
            self.post_message(LoadFailed(str(exc)))
            return
        except Exception as exc:  # anything else at load: said as such, never a half-started app
            self.post_message(LoadFailed(f"{type(exc).__name__}: {exc}"))
            return
        session = self.session
        query, kv = introspect.attention_heads(loaded.model.config)
        sampler = session.config.sampler.describe()
        capacity = f" {session.capacity}" if session.capacity else ""
        self.post_message(ModelReady(
            f"{loaded.source} · {type(loaded.model).__name__} · {loaded.device} · {loaded.dtype} · "
            f"{session.config.cache}{capacity} cache · {sampler}", query, kv))

    def on_load_progress(self, message: LoadProgress) -> None:
        share = f" {message.fraction:.0%}" if message.fraction is not None else ""
        self.query_one(StatusBar).set_text(f"⏳ {message.text}{share}")

    def on_model_ready(self, message: ModelReady) -> None:
        self.model_text = message.description
        self.query_one(StatusBar).set_text(message.description)
        self.query_one(LayersPane).set_model_info(message.query_heads, message.kv_heads)
        self._show_next_script_turn()
        if self._queued is not None:  # typed while the model loaded: send it now
            text, self._queued = self._queued, None
            self.notify(f"model ready: sending {text!r}", timeout=3)
            self._engine("send", text)
        else:
            self.notify("model ready: type a message and press Enter", timeout=3)

    def on_load_failed(self, message: LoadFailed) -> None:
        self._load_failed = True
        if self._queued is not None:
            self.notify(f"not sent (no model): {self._queued!r}", severity="warning", timeout=10)
            self._queued = None
        self.model_text = f"no model: {message.error}"
        self.query_one(StatusBar).set_text(f"✗ {message.error}")
        self.notify(f"{message.error}\nq quits; fix the model or the options and start kvtui again",
                    title="model not loaded", severity="error", timeout=30)

    # ---- engine actions (one worker at a time; each cancels the one before) ---------------------

    def _engine(self, action: str, argument=None) -> None:
        if self.session is None and action == "send" and not self._load_failed:
            replaced = " (replaces the one queued before)" if self._queued is not None else ""
            self._queued = argument
            self.notify(f"queued {argument!r}{replaced}: it is sent when the model is ready", timeout=4)
            return
        if self.session is None:
            self.notify("the model is not loaded yet" if "✗" not in self.model_text else self.model_text,
                        severity="warning")
            return
        self.engine_worker(action, argument)

    @work(thread=True, exclusive=True, exit_on_error=False, group="engine")
    def engine_worker(self, action: str, argument=None) -> None:
        from .engine.export import ExportError, export_cache
        from .engine.session import SessionError

        worker = get_current_worker()
        with self._engine_lock:
            if worker.is_cancelled:
                return
            session = self.session
            try:
                if action == "send":
                    ui_before = self._ui_cpu_now()
                    session.send(argument)
                    self._prefill_ui_ms = _ui_ms_since(ui_before)
                    if not self.step_mode:
                        self._run(session, worker)
                elif action == "step":
                    session.step()
                elif action == "run":
                    self._run(session, worker)
                elif action == "rewind":
                    self._after_rewind(session, session.rewind(argument))
                elif action == "rewind_to":
                    self._after_rewind(session, session.rewind_to(argument))
                elif action == "force":
                    token = session.force(argument)
                    session.step()
                    if not self.step_mode:
                        self._run(session, worker)
                    self._state(session, f"forced {token.text!r} (id {token.id}, rank {token.rank})")
                elif action == "verify":
                    ui_before = self._ui_cpu_now()
                    result = session.verify()
                    self._verify_ui_ms = _ui_ms_since(ui_before)
                    verdict = "matches" if result.ok else "DIFFERS FROM"
                    self._state(session, f"cache {verdict} a full recompute of {result.tokens} tokens: max |diff| "
                                         f"{result.max_abs_diff:.2e} (tolerance {result.tolerance:g}), top-k "
                                         f"{'agrees' if result.topk_agree else 'differs'} · {result.ms:.0f} ms",
                                "information" if result.ok else "error", verify=result)
                elif action == "sampler":
                    session.set_sampler(argument)
                    self._state(session, f"sampler: {argument.describe()}")
                elif action == "reset":
                    session.reset()
                    self._state(session, "cache and chat reset")
                elif action == "export":
                    path = export_cache(session, Path.cwd() / f"kvtui-cache-step{session.steps}.safetensors")
                    self._state(session, f"cache at step {session.steps} exported to {path} "
                                         "(kvtui.engine.export.load_cache reads it back)")
            except (SessionError, ExportError) as exc:
                self._state(session, str(exc), "error")
            finally:
                self.running = False

    def _ui_cpu_now(self) -> float | None:
        # with an injected clock (tests, screenshots) every timing is fake: no real load note either
        return None if self._clock is not None else _ui_cpu()

    def _run(self, session, worker: Worker) -> None:
        self.running = True
        session.generate(cancel=worker.cancelled_event)
        self._state(session)  # the whole reply, whatever the throttled snapshots carried

    def _after_rewind(self, session, snapshot) -> None:
        if snapshot is None:
            self._state(session, "cache empty")

    def _on_engine_snapshot(self, snapshot: StepSnapshot) -> None:
        """Called by the session in the worker thread after every forward."""
        session = self.session
        messages = None
        now = time.monotonic()
        if not self.running or snapshot.phase != "decode" or now - self._messages_at >= 1 / REFRESH_HZ:
            messages, self._messages_at = session.messages, now
        self.post_message(SnapshotReady(snapshot, messages, tuple(session.diagnostics), self.running))

    def _state(self, session, note: str = "", severity: str = "information", verify=None) -> None:
        self.post_message(SessionState(session.messages, tuple(session.diagnostics), note, severity, verify))

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.state == WorkerState.ERROR:
            error = event.worker.error
            text = f"{type(error).__name__}: {error}"
            step = self.latest.step if self.latest else 0
            self.app_diagnostics.append(Diagnostic("worker-error", "error", f"{event.worker.name}: {text}", step))
            self._show_diagnostics()
            self.notify(f"{text}\nthe session is as it was before this action: go on, v verifies it, q quits",
                        title="error in the model worker (session kept)", severity="error", timeout=10)

    # ---- snapshots -> panes ----------------------------------------------------------------------

    def on_snapshot_ready(self, message: SnapshotReady) -> None:
        snapshot = message.snapshot
        self.latest = snapshot
        self.history.append(snapshot)
        self.diagnostics = message.diagnostics
        if message.messages is not None:
            self.messages = message.messages
        if snapshot.phase == "decode" and snapshot.compile_ms is None:  # a compiling step is not a slow step
            self._recent_ms.append(snapshot.forward_ms + snapshot.snapshot_ms)
        elif snapshot.phase == "prefill":
            self._prefill = snapshot
        self.query_one(StatusBar).record(snapshot)
        # Repaint at most REFRESH_HZ times a second: on 2 cores every repaint is time the model waits for.
        wait = self._last_paint + 1 / REFRESH_HZ - time.monotonic()
        if wait <= 0 or not message.running:  # single steps paint at once
            if self._paint_timer is not None:
                self._paint_timer.stop()
            self._paint()
        elif self._paint_timer is None:
            self._paint_timer = self.set_timer(wait, self._paint)

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
        speed = 1000 * len(self._recent_ms) / sum(self._recent_ms) if self._recent_ms else None
        self.query_one(StatusBar).show(snapshot, self.model_text, speed)

    def on_session_state(self, message: SessionState) -> None:
        self.messages, self.diagnostics = message.messages, message.diagnostics
        if message.verify is not None:
            self._last_verify = message.verify
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
        text = (f"turn {snapshot.turn} · reused {reused} cached tokens, fed {fed} ({share:.0%} reuse) · "
                f"prefill {prefill.forward_ms:.0f} ms{_load_note(self._prefill_ui_ms, prefill.forward_ms)}")
        verify = self._last_verify
        if verify is not None:
            text += (f" · full re-encode of {verify.tokens} tokens: {verify.ms:.0f} ms"
                     f"{_load_note(self._verify_ui_ms, verify.ms)}")
        else:
            text += " · v measures a full re-encode"
        return text

    def _show_diagnostics(self) -> None:
        merged = tuple(sorted(self.diagnostics + tuple(self.app_diagnostics), key=lambda d: d.step))
        self.query_one(DiagnosticsPane).show_diagnostics(merged)

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
        placeholder = (f"Enter (here or in the cache pane) sends the script's next turn: {self.script_turns[0]}"
                       if self.script_turns else "Type a message, Enter to send")
        self.query_one(ChatPane).input.placeholder = placeholder

    def action_focus_input(self) -> None:
        self.query_one(ChatPane).input.focus()

    def action_step(self) -> None:
        self._engine("step")

    def action_run(self) -> None:
        self._engine("run")

    def action_pause(self) -> None:
        self.workers.cancel_group(self, "engine")

    def action_stop(self) -> None:
        if isinstance(self.focused, Input):
            self.query_one(TokenBufferPane).focus()
            return
        if self.pinned_step is not None:
            self.action_live()
            return
        self.workers.cancel_group(self, "engine")

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
        self.notify("step mode: Enter prefills, space steps" if self.step_mode else "run mode: Enter runs the turn",
                    timeout=3)

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

        self.push_screen(SamplerModal(self.session.config.sampler), apply)

    @on(LayersPane.LayerSelected)
    def layer_selected(self, message: LayersPane.LayerSelected) -> None:
        self.query_one(TokenBufferPane).selected_layer = message.index
        if self.session is not None:
            self.session.attention_layer = message.index  # an int swap, read at the next forward

    def action_watch(self) -> None:
        token = self.query_one(TopKPane).selected_token
        if token is None or self.session is None:
            self.notify("select a token in the top-k pane first", severity="warning")
            return
        self.session.watch_token(token.id)  # a tuple swap, read at the next forward; recorded
        self.notify(f"watching {token.text!r} (id {token.id}): its rank shows in top-k from the next step", timeout=4)

    @on(DiagnosticsPane.JumpTo)
    def jump_to(self, message: DiagnosticsPane.JumpTo) -> None:
        found = self._find_step(message.step)
        if found is None:
            self.notify(f"step {message.step} is older than the last {HISTORY_STEPS} kept in memory "
                        f"(it is in the trace)", severity="warning")
            return
        self.pinned_step = message.step
        self._show(found)
        self.notify(f"showing step {message.step}: press g (or Esc) to go back to the live step", timeout=5)

    def _find_step(self, step: int) -> StepSnapshot | None:
        return next((s for s in self.history if s.step == step), None)

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
        self.push_screen(HelpScreen(self.BINDINGS))

    def action_next_theme(self) -> None:
        names = sorted(self._themes)
        self.theme = names[(names.index(self.theme) + 1) % len(names)] if self.theme in names else names[0]
        self._apply_layout()
        self.notify(f"theme: {self.theme}", timeout=2)

    def action_save_trace(self) -> None:
        if self._recorder is None:
            self.notify("nothing recorded yet", severity="warning")
            return
        if self.trace_path is not None:
            self.notify(f"the trace is being written to {self.trace_path}", timeout=5)
            return
        target = Path.cwd() / f"kvtui-trace-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
        try:
            partial = target.with_suffix(".jsonl.part")
            shutil.copyfile(self._spool, partial)
            os.replace(partial, target)  # never a half-written trace under the real name
        except OSError as exc:
            self.notify(f"could not save the trace to {target}: {exc}", severity="error")
            return
        self.notify(f"trace saved to {target}", timeout=6)

    def action_screenshot(self) -> None:
        path = self.save_screenshot()
        self.notify(f"screenshot saved to {path}", timeout=6)

    async def action_quit(self) -> None:
        """Quit at any moment: cancel the engine, wait for its thread to finish its forward, then exit."""
        self.workers.cancel_group(self, "engine")
        for worker in list(self.workers):
            if worker.group == "engine":
                try:
                    await worker.wait()
                except Exception:  # a failed or cancelled worker is finished all the same
                    pass
        self.exit()

    def on_unmount(self) -> None:
        if self._paint_timer is not None:
            self._paint_timer.stop()
        if self._recorder:
            self._recorder.close()
        if self._spool and self._spool.exists():
            self._spool.unlink()

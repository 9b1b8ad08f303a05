"""kvtui's own chat: the model runs in the engine process (engine/chat/host.py), never in the app's interpreter.
Keys become commands on its control pipe; one thread worker (the pump, group "engine") reads its records,
rebuilds each step's snapshot and posts it (snapshots coalesce in run mode). If the engine process dies, the
app says so and R restarts it with the chat so far."""

from __future__ import annotations

import gc
import os
import shutil
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from textual.worker import get_current_worker

from ..engine.chat.remote import RemoteSession, diagnostics_from
from ..engine.chat.settings import SamplerSettings
from ..engine.records.codec import from_record, to_record
from ..engine.records.snapshot import Diagnostic, StepSnapshot, VerifyResult
from ..messages import Call, SessionState, SnapshotReady
from ..options import AppConfig
from ..widgets.step.chat_pane import ChatPane
from ..widgets.step.layers_pane import LayersPane
from ..widgets.step.sampler_modal import SamplerModal
from .base import Driver, ui_cpu
from .reuse import ReuseMeter

if TYPE_CHECKING:
    from ..engine.records.replay import SnapshotBuilder

HISTORY_STEPS = 512  # snapshots kept for "jump to step"; older steps live in the trace on disk


def _verify_result(state: dict) -> VerifyResult | None:
    verify = state.get("verify")
    if not verify:
        return None
    return from_record(VerifyResult, verify)


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


CHAT_HELP = """
Send a message with Enter in the input box (i focuses it, Esc leaves it). By default the reply runs to
the end of the turn; in step mode (m) only the prompt is prefilled and you step with space.
Select a token in the buffer (arrows, click) and press backspace to rewind the cache to it.
Select a row in top-k and press f to force that token instead of the sampled one.
The line under the chat is the reuse meter: what this turn took from the cache, what it fed, and (after v)
what a full re-encode costs.
"""


class ChatDriver(Driver):
    """The engine process's records in, its commands out. The session's facts (`session`) come from them."""

    HELP = CHAT_HELP
    EMPTY = "cache empty — send a message"

    def __init__(self, config: AppConfig, *, loaded=None, clock=None, loader=None, engine_setup=None):
        """`loaded`, `loader`, `clock` and `engine_setup` go to the engine process and must pickle (see
        viewers.chat)."""
        self.config = config
        self.clock = clock
        self._engine_objects = dict(loaded=loaded, loader=loader, clock=clock, engine_setup=engine_setup)
        self.source: Any = None  # the engine process (engine/chat/host.py EngineSource)
        self.session = None  # its facts, from its `ready` record on (None again while R restarts it)
        self.history: deque[StepSnapshot] = deque(maxlen=HISTORY_STEPS)  # the newest steps, every one
        self.load_failed = False
        self.dead: str | None = None  # why the engine process ended, until R restarts it
        self.queued: str | None = None  # a message sent before the model was ready: sent once it is
        self.pending = 0  # commands sent to the engine and not answered yet
        # the texts of the sends not answered yet, in order (None: a script's turn, never put back in the input: the
        # next Enter sends the script's next turn, as --headless goes on to it, so both write the same trace)
        self.sends: deque[str | None] = deque()
        self._script_send = False  # the next send is the script's turn next_turn() gave
        # step records -> snapshots; kept across engine restarts (the buffer goes on)
        self._builder: SnapshotBuilder | None = None
        self._quitting = False
        self.meter = ReuseMeter()  # the line under the chat
        self.script_turns = list(config.script.turns) if config.script else []  # --script: turns not sent yet

    # ---- the engine process -------------------------------------------------------------------------

    def start(self, restore: dict | None = None) -> None:
        """Start the engine process (it loads the model and streams its progress) and read it, in a worker."""
        self.app.run_reader(lambda: self._pump(restore), name="pump", group="engine")

    @property
    def busy(self) -> bool:
        return self.pending > 0

    def _pump(self, restore: dict | None) -> None:
        """(worker thread) Start the engine process and turn its records into messages, until it ends."""
        from ..engine.chat.host import EngineSetup, EngineSource
        from ..engine.records.replay import SnapshotBuilder
        from ..engine.records.stream import ListCopy

        app, post = self.app, self.app.post_message
        worker = get_current_worker()
        try:
            if self.source is None:
                trace = str(self.config.trace_path) if self.config.trace_path is not None else None  # None: spool
                setup = EngineSetup(
                    self.config.model, self.config.options, trace, self.config.verify_every, **self._engine_objects
                )
                source = EngineSource(setup)
            else:  # R after the engine died: the next process appends to the same trace
                source = self.source.restarted(restore)
        except Exception as exc:  # noqa: BLE001  a model object that neither pickles nor saves, a full disk
            post(Call(self._failed, (f"could not hand the model to the engine process: {type(exc).__name__}: {exc}",)))
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
                self.meter.arrived(snapshot)
                app.record_step(snapshot)  # likewise: its sparkline point and tok/s sample
                post(
                    SnapshotReady(
                        snapshot, messages, diagnostics, bool(facts and facts["running"]), facts, recorded=True
                    )
                )
                messages = facts = None
            elif kind == "state":
                chat.update(record, "messages")
                alarms.update(record, "diagnostics")
                diagnostics = diagnostics_from(alarms.items)
                post(
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
                post(Call(self._progress, (record["text"], record.get("fraction"))))
            elif kind == "ready":
                post(Call(self._ready, (record,)))
            elif kind == "load-failed":
                failed = True
                post(Call(self._failed, (record["error"],)))
            elif kind == "output" and record["stream"] == "stderr" and record["text"].strip():
                errors.append(record["text"])
            elif kind == "process-exit" and not failed and not self._quitting:
                post(Call(self._exited, (_exit_reason(record["code"], errors),)))

    def _progress(self, text: str, fraction: float | None) -> None:
        share = f" {fraction:.0%}" if fraction is not None else ""
        self.app.show_status(f"⏳ {text}{share}")

    def _ready(self, record: dict) -> None:
        app = self.app
        restarted = self.dead is not None
        self.dead = None
        self.session = session = RemoteSession(record)
        if app.latest is not None:
            session.buffer = app.latest.buffer
        app.describe_model(session.description)
        app.query_one(LayersPane).set_model_info(session.query_heads, session.kv_heads)
        # What exists now (Textual, the panes, a `loaded=` model) lives as long as the app: out of the cyclic
        # collector's scans, whose full passes over it would take CPU from the engine while it runs.
        gc.collect()
        gc.freeze()
        if restarted:
            return  # the restore command was queued with the start: its state says what happened
        app.show_next_script_turn()
        if self.queued is not None:  # typed while the model loaded: send it now
            text, self.queued = self.queued, None
            app.notify(f"model ready: sending {text!r}", timeout=3)
            self.command("send", text)
        else:
            app.notify("model ready: type a message and press Enter", timeout=3)

    def _failed(self, error: str) -> None:
        app = self.app
        self.load_failed = True
        self.pending = 0  # a restore queued with a restart that could not load
        if self.queued is not None:
            app.notify(f"not sent (no model): {self.queued!r}", severity="warning", timeout=10)
            self.queued = None
        app.describe_model(f"no model: {error}", status=f"✗ {error}")
        app.notify(
            f"{error}\nq quits; fix the model or the options and start kvtui again",
            title="model not loaded",
            severity="error",
            timeout=30,
        )

    def _exited(self, error: str) -> None:
        self.dead = error
        self.pending = 0
        self.sends.clear()
        self.app.show_status(f"✗ engine stopped: {error} · R restarts it")
        self.app.report_error(
            f"engine process: {error}",
            error,
            "R restarts the engine and replays the chat so far into a fresh cache; q quits",
            "the engine process died",
            timeout=30,
        )

    def restart(self) -> None:
        """R: a fresh engine process; the chat so far is fed into its new cache in one forward."""
        app = self.app
        if self.dead is None:
            app.notify("the engine is running: R restarts it only after it stopped", timeout=3)
            return
        restore = None
        if self.session is not None:
            tokens = app.latest.buffer if app.latest is not None else ()
            restore = {"tokens": [to_record(t) for t in tokens], "state": self.session.restorable}
        self.session = None
        self.pending = 1 if restore else 0
        app.show_status("⏳ restarting the engine")
        self.start(restore)

    def stop(self) -> None:
        self._quitting = True
        if self.source is not None:
            self.source.stop()  # at once when it is gone already; else it closes its trace first; its files go

    # ---- commands ----------------------------------------------------------------------------------

    def command(self, action: str, argument: Any = None) -> None:
        app = self.app
        scripted, self._script_send = self._script_send, False
        if self.session is None and action == "send" and not self.load_failed and self.dead is None:
            replaced = " (replaces the one queued before)" if self.queued is not None else ""
            self.queued = argument
            app.notify(f"queued {argument!r}{replaced}: it is sent when the model is ready", timeout=4)
            return
        if self.dead is not None:
            app.notify(f"the engine process stopped ({self.dead}): R restarts it", severity="warning")
            return
        if self.session is None:
            app.notify(
                "the model is not loaded yet" if "✗" not in app.model_text else app.model_text, severity="warning"
            )
            return
        run = not app.step_mode
        if action == "send":
            self.meter.sent("prefill", self._ui_cpu_now())
            self.sends.append(None if scripted else argument)
            argument = {"text": argument, "run": run}
        elif action == "force":
            argument = {"id": argument, "run": run}
        elif action == "sampler":
            argument = asdict(argument)
        elif action == "verify":
            self.meter.sent("verify", self._ui_cpu_now())
        self.pending += 1
        self.source.command(action, argument)

    def _ui_cpu_now(self) -> float | None:
        # with an injected clock (tests, screenshots) every timing is fake: no real load note either
        return None if self.clock is not None else ui_cpu()

    def state(self, record: dict) -> None:
        verify = _verify_result(record)
        if verify is not None:
            self.meter.verified(verify)
        if record.get("done"):
            self.pending = max(0, self.pending - 1)
        if record.get("done") == "reset" and not record.get("error"):
            self.meter = ReuseMeter()  # its prefill and verify timings were the old conversation's
        if record.get("done") == "send" and self.sends:
            text = self.sends.popleft()
            chat_input = self.app.query_one(ChatPane).input
            refused = record.get("severity") == "error" or record.get("error")
            if text is not None and refused and not chat_input.value:
                chat_input.value = text  # refused (a full static cache): the message is kept to edit or send again
        if self.session is not None and record:
            before = self.session.sampler
            self.session.update(record)
            if self.session.sampler != before:  # `o`: the status line names the sampler
                self.app.describe_model(self.session.description)

    def pause(self) -> None:
        if self.source is not None:
            self.source.command("pause")  # answered by the engine's control thread, mid-turn

    def stop_turn(self) -> None:
        self.pause()

    def title(self) -> tuple[str, str]:
        mode = "step mode" if self.app.step_mode else "run mode"
        latest = self.app.latest
        if self.busy:
            state = f"{mode} · running"
        elif latest is not None and not latest.turn_done:  # p mid-turn, or stepping: r or space goes on
            state = f"{mode} · paused"
        else:
            state = mode
        return state, f"{self.app.title} · {mode}"

    def reuse_text(self, snapshot: StepSnapshot) -> str:
        return self.meter.text(snapshot)

    def next_turn(self) -> str | None:
        if not self.script_turns:
            return None
        self._script_send = True
        return self.script_turns.pop(0)

    def input_placeholder(self) -> str:
        if self.script_turns:
            return f"Enter (here or in the cache pane) sends the script's next turn: {self.script_turns[0]}"
        return super().input_placeholder()

    def find_step(self, step: int) -> StepSnapshot | None:
        return next((s for s in list(self.history) if s.step == step), None)  # list(): one C call, the pump appends

    def sampler(self) -> None:
        if self.session is None:
            self.app.notify("the model is not loaded yet", severity="warning")
            return

        def apply(settings: SamplerSettings | None) -> None:
            if settings is not None:
                self.command("sampler", settings)

        self.app.push_screen(SamplerModal(self.session.sampler), apply)

    def attention(self, layer: int) -> None:
        if self.session is not None:
            self.source.command("attention", layer)  # an int swap there, read at the next forward

    def watch(self, token) -> None:
        if self.session is None:
            self.app.notify("the model is not loaded yet", severity="warning")
            return
        self.source.command("watch", token.id)  # a tuple swap there, between two forwards; recorded
        self.app.notify(
            f"watching {token.text!r} (id {token.id}): its rank shows in top-k from the next step", timeout=4
        )

    def save_trace(self) -> None:
        app = self.app
        if self.session is None and app.latest is None:
            app.notify("nothing recorded yet", severity="warning")
            return
        if self.config.trace_path is not None:
            app.notify(f"the trace is being written to {self.config.trace_path}", timeout=5)
            return
        target = Path.cwd() / f"kvtui-trace-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
        try:
            partial = target.with_suffix(".jsonl.part")
            shutil.copyfile(self.source.trace_path, partial)
            os.replace(partial, target)  # never a half-written trace under the real name
        except OSError as exc:
            app.notify(f"could not save the trace to {target}: {exc}", severity="error")
            return
        app.notify(f"trace saved to {target}", timeout=6)

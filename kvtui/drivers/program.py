"""`kvtui watch SCRIPT` (and `-m MODULE`, `-- COMMAND`): the panes on a live stream of step records. The source
(a program in a child process, a command's tree of processes) is an argument: its records are read in a worker
thread, and keys send it commands (pause, step, run, ...). A trace, finished or still being written, is
TraceDriver's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from textual.binding import Binding
from textual.css.query import NoMatches
from textual.screen import ModalScreen
from textual.worker import get_current_worker

from ..engine.records.replay import Replay
from ..engine.records.snapshot import Diagnostic, StepSnapshot
from ..engine.records.trace import Trace
from ..fmt import evicted_text, printable, quantization_text
from ..messages import Call, SnapshotReady
from ..widgets.step.chat_pane import ChatPane, program_step_text
from ..widgets.step.program_input import ProgramInput
from ..widgets.step.program_output import ProgramOutput
from ..widgets.step.token_buffer import TokenBufferPane
from .base import Driver

# Keys kvtui's own chat has and a watched program's stream cannot honour (by action name), with why.
OBSERVE_ONLY = {
    "send": "a watched program writes its own prompts: kvtui only observes its forwards",
    "rewind": "rewinding would change the program's cache behind its back: kvtui only observes",
    "rewind_to": "rewinding would change the program's cache behind its back: kvtui only observes",
    "force": "forcing a token would change the program: kvtui only observes its forwards",
    "reset": "resetting would change the program's cache: kvtui only observes",
    "sampler": "the program samples on its own: its sampler is not kvtui's",
    "export_cache": "export is not available for a watched program yet (pause, then use the trace)",
    "toggle_step_mode": "the program decides how it generates: space steps its forwards one at a time",
    "next_script_turn": "a watched program writes its own prompts: kvtui has no script to send",
    "restart_engine": "a watched program has no kvtui engine to restart",
}
# Keys that are commands to the stream's source (one that does not take a command: the key is disabled).
SOURCE_COMMANDS = {
    "step": "step",
    "run": "run",
    "pause": "pause",
    "verify": "verify",
    "watch": "watch",
    "break_on_alarm": "break",
}


class ProgramDriver(Driver):
    EMPTY = "no forward yet: the cache shows from the program's first forward"
    HELP = """
A watched program computes as it would unwatched: kvtui observes its forwards and never drives its model.
space steps its forwards one at a time (the program pauses before its next one), r lets it run, p pauses it,
b pauses it after a step that raised an alarm. i types a line to its stdin (ctrl+d closes it, ctrl+c
interrupts it, Esc gives the keys back). n shows the next batch row; M one model's steps at a time.
"""
    BINDINGS = [
        Binding("b", "break_on_alarm", "break on alarm"),
        Binding("n", "next_row", "next batch row (continuous batching: next request)", show=False),
        Binding("M", "next_model", "model filter", show=False),
        Binding("i", "focus_input", "type to the program"),
    ]

    def __init__(
        self,
        target: str | None = None,
        args: list[str] | None = None,
        *,
        module: bool = False,
        trace_path: Path | None = None,
        paused: bool = False,
        break_on_alarm: bool = False,
        top_k: int = 10,
        source=None,
        title: str | None = None,
        attention: bool = False,
    ):
        """A program to start (`target`, `args`, `module`) or a started `source` (a TreeSource, a fake)."""
        self._source_args: dict[str, Any] = dict(
            target=target,
            args=list(args or []),
            module=module,
            trace=trace_path,
            paused=paused,
            break_on_alarm=break_on_alarm,
            top_k=top_k,
            attention=attention,
        )
        self.source: Any = source
        self.label = title or (f"{'-m ' if module else ''}{target}" if target else "stream")
        self.replay = Replay(Trace(Path(self.label), {}))
        self.paused = paused
        self.break_on_alarm = break_on_alarm
        self.ended: int | None = None  # the program's exit code once it ended
        self._prompted = False  # the input took the focus once, at the program's first prompt
        self.models: list[str] = []  # labels of the models whose steps arrived ("model 1: draft"), in order
        self.model_filter: str | None = None  # show only this model's steps (M cycles); None: all

    # ---- the source --------------------------------------------------------------------------------

    def start(self) -> None:
        app = self.app
        chat = app.query_one(ChatPane)
        chat.query_one("#transcript").display = False
        chat.mount(ProgramOutput(id="program-output"), before=chat.query_one("#reuse"))
        chat.input.disabled = True
        chat.input.placeholder = "space step · r run · p pause · b break on alarm · n next row · q quit"
        app.query_one(TokenBufferPane).focus()
        if self.source is None:
            from ..engine.watch.child import ProgramSource

            self.source = ProgramSource(**self._source_args)
        if hasattr(self.source, "write_stdin"):  # a program that reads its stdin from this input line
            chat.input.display = False  # the footer lists the keys; one input line, the program's
            chat.mount(ProgramInput(id="program-input"), before=chat.query_one("#reuse"))
        app.describe_model(f"watching {self.label} · waiting for its first model…")
        app.run_reader(self._pump, name="stream", group="stream")

    def _pump(self) -> None:
        """(worker thread) Read the source's records; steps become snapshots (rebuilt exactly as replay does)."""
        worker = get_current_worker()
        replay, post = self.replay, self.app.post_message  # its running totals (alarms, re-encodes) are replay's
        for record in self.source.records(stop=worker.cancelled_event):
            kind = record.get("type")
            if kind == "step":
                snapshot = replay.add(record)
                if snapshot.model and snapshot.model not in self.models:
                    self.models = [*self.models, snapshot.model]  # a new list: the UI thread reads it whole
                if self.model_filter is not None and snapshot.model != self.model_filter:
                    continue  # kept in the history; not shown while another model is picked
                post(SnapshotReady(snapshot, None, replay.diagnostics, running=not self.paused))
                continue
            if kind in ("diagnostic", "header"):
                replay.add_record(record)
            post(Call(self._record, (record, replay.diagnostics if kind == "diagnostic" else None)))

    def _record(self, record: dict, diagnostics: tuple[Diagnostic, ...] | None) -> None:
        """A record that is not a step: output, pauses, breaks, notices, the end (`diagnostics`: every alarm so
        far, when this record added one)."""
        app = self.app
        kind = record.get("type")
        if diagnostics is not None:
            app.show_diagnostics(diagnostics)
        if kind == "output":
            app.query_one(ProgramOutput).add(record["stream"], record["text"], bool(record.get("partial")))
            if record.get("partial") and record["stream"] == "stdout" and not self._prompted:
                self._prompted = True  # a prompt: the person can just type (once; esc gives the keys back)
                program_input = self._program_input()
                if program_input is not None and not program_input.disabled and not isinstance(app.screen, ModalScreen):
                    program_input.focus()
        elif kind == "header":
            app.describe_model(
                f"watching {self.label} · {record.get('model_class', '?')} · {record.get('device', '?')} · "
                f"{record.get('dtype', '?')} · transformers {record.get('transformers', '?')}"
            )
        elif kind == "paused":
            self._set_paused(True)
        elif kind == "break":
            self._set_paused(True)
            app.notify(
                f"break on alarm after step {record['step']}: {', '.join(record.get('codes', []))} "
                "(space steps, r runs)",
                severity="warning",
                timeout=8,
            )
        elif kind == "verify" and record.get("compressed_kl") is not None:  # a compressed cache: its cost
            app.notify(
                f"the program's compressed cache against the uncompressed recompute of {record['tokens']} tokens: "
                f"top-1 {'agrees' if record['compressed_top1'] else 'differs'}, KL {record['compressed_kl']:.4g} nats"
                + evicted_text(tuple(record["evicted_attention"]) if record.get("evicted_attention") else None),
                timeout=10,
            )
        elif kind == "verify":
            verdict = "matches" if record["ok"] else "DIFFERS FROM"
            app.notify(
                f"the program's cache {verdict} a full recompute of {record['tokens']} tokens: max |diff| "
                f"{record['max_abs_diff']:.2e} (tolerance {record['tolerance']:g})"
                + quantization_text(tuple(map(tuple, record["layer_errors"])) if record.get("layer_errors") else None),
                severity="information" if record["ok"] else "error",
                timeout=10,
            )
        elif kind == "notice":
            app.notify(printable(record["text"]), severity=record.get("severity", "information"), timeout=5)
        elif kind in ("program-exit", "process-exit"):
            if self.ended is None:
                self.ended = record.get("code", 0)
                self._set_paused(False)
                self._close_input(f"the program has ended (exit code {self.ended}): it reads no more input")
                app.notify(
                    f"the program ended (exit code {self.ended}): everything stays here to inspect; q quits", timeout=8
                )

    def _set_paused(self, paused: bool) -> None:
        self.paused = paused
        self.app.update_title()

    def stop(self) -> None:
        if self.source is not None:
            self.source.stop()

    # ---- what the panes show ----------------------------------------------------------------------

    def reuse_text(self, snapshot: StepSnapshot) -> str | None:
        return program_step_text(snapshot, self.row, self.replay.recomputed_through(len(self.replay) - 1))

    def title(self) -> tuple[str, str]:
        state = f"ended · exit {self.ended}" if self.ended is not None else "paused" if self.paused else "running"
        return state, f"kvtui · watch · {self.label} · {state}"

    def find_step(self, step: int) -> StepSnapshot | None:
        return self.replay.snapshot_at(step)

    # ---- the program's stdin ------------------------------------------------------------------------

    def _program_input(self) -> ProgramInput | None:
        try:
            return self.app.query_one(ProgramInput)
        except NoMatches:  # a source that reads no stdin has none
            return None

    def _close_input(self, why: str) -> None:
        program_input = self._program_input()
        if program_input is None or program_input.disabled:
            return
        had_focus = program_input.has_focus
        program_input.close(why)
        if had_focus:
            self.app.query_one(TokenBufferPane).focus()

    def focus_input(self) -> None:
        program_input = self._program_input()
        if program_input is None:
            self.app.notify("this stream has no program to type to", severity="warning")
        elif program_input.disabled:
            self.app.notify(program_input.placeholder, severity="warning", timeout=4)
        else:
            program_input.focus()

    def send_line(self, text: str) -> None:
        if not self.source.write_stdin(text + "\n"):
            why = (
                "the program has ended"
                if not self.source.running
                else "its input is closed"
                if not self.source.stdin_open
                else "it is not reading its input (64 KiB are waiting)"
            )
            self.app.notify(f"not sent: {why}", severity="warning", timeout=5)

    def end_input(self) -> None:
        self.source.close_stdin()
        self._close_input("the program's input is closed (ctrl+d sent EOF)")

    def interrupt(self) -> None:
        if self.source.interrupt():
            self.app.notify("ctrl+c: SIGINT sent to the program (a KeyboardInterrupt in Python)", timeout=4)
        else:
            self.app.notify("the program has ended: nothing to interrupt", severity="warning", timeout=4)

    # ---- keys --------------------------------------------------------------------------------------

    def unavailable(self, action: str) -> str | None:
        if action in OBSERVE_ONLY:
            return OBSERVE_ONLY[action]
        command = SOURCE_COMMANDS.get(action)
        if command is not None and command not in getattr(self.source, "supports", ()):
            return "this stream takes no commands"
        return None

    def _send(self, word: str, argument: Any = None) -> bool:
        if self.source is None or word not in getattr(self.source, "supports", ()):
            self.app.notify("this stream takes no commands", severity="warning")
            return False
        if self.ended is not None:
            self.app.notify(f"the program has ended (exit code {self.ended})", severity="warning")
            return False
        self.source.command(word, argument)
        return True

    def command(self, action: str, argument: Any = None) -> None:
        if action == "step":
            if self._send("pause") and self._send("step"):
                self._set_paused(True)
        elif action == "run":
            if self._send("run"):
                self._set_paused(False)
        elif action == "verify":
            if self._send("verify"):
                self.app.notify("verify runs in the program between two of its forwards", timeout=3)
        else:
            why = OBSERVE_ONLY.get("export_cache" if action == "export" else action)
            self.app.notify(why or f"'{action}' is not available for a watched program", severity="warning")

    def attention(self, layer: int) -> None:
        if "attention" in getattr(self.source, "supports", ()) and self.ended is None:
            self.source.command("attention", layer)  # the program's next steps keep that layer's heads

    def pause(self) -> None:
        if self._send("pause"):
            self._set_paused(True)

    def toggle_break_on_alarm(self) -> None:
        self.break_on_alarm = not self.break_on_alarm
        self._send("break", "on" if self.break_on_alarm else "off")

    def next_model(self) -> None:
        """Show one model's steps (a draft and its target, two models in threads), then all again."""
        choices = [None, *self.models]
        if len(choices) < 3:
            self.app.notify("one model: nothing to filter", timeout=2)
            return
        self.model_filter = choices[(choices.index(self.model_filter) + 1) % len(choices)]
        self.app.notify(f"showing {self.model_filter or 'every model'}'s steps", timeout=3)

    def watch(self, token) -> None:
        self._send("watch", token.id)

    def save_trace(self) -> None:
        path = self._source_args.get("trace")
        self.app.notify(
            f"the trace is being written to {path}" if path else "start with --trace FILE to record a watched program",
            timeout=5,
        )

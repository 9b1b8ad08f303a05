"""A watched program in a child process: its entry point (`python -m kvtui.engine.watch.child`), the gate through
which the viewer pauses and steps it, and `ProgramSource`, the viewer's side of it."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from ..records.child import ChildSource
from ..records.stream import RecordPipe, parse_command
from .deferred import Gate, run_deferred


def control_gate(
    control_fd: int, pipe: RecordPipe, start_paused: bool = False, break_on_alarm: bool = False, on_gone=None
):
    """A probe Gate that holds the program before a forward while the viewer says pause. `on_gone()` runs
    when the viewer's end of the control channel closes (by default the process exits at once)."""

    class ControlGate(Gate):
        def __init__(self):
            self.paused = start_paused
            self.break_on_alarm = break_on_alarm
            self.allowed = 0  # forwards a "step" lets through while paused
            self.requests: list[tuple[str, Any]] = []  # commands that must run in the program's thread
            self.watcher = None
            self._condition = threading.Condition()
            threading.Thread(target=self._read, args=(control_fd,), name="kvtui-control", daemon=True).start()

        def _read(self, fd: int) -> None:
            try:
                with os.fdopen(fd, "r", encoding="utf-8", errors="replace") as commands:
                    for line in commands:
                        self._command(*parse_command(line))
            except OSError:  # a socket reset: a viewer SIGKILLed before it accepted this connection
                pass
            # the viewer is gone (quit, crash or SIGKILL): the watched program goes with it
            (on_gone or (lambda: os._exit(143)))()

        def _command(self, word: str, argument) -> None:
            with self._condition:
                if word == "pause":
                    self.paused = True
                elif word == "run":
                    self.paused, self.allowed = False, 0
                elif word == "step":
                    self.allowed += 1
                elif word == "break" and argument in ("on", "off"):
                    self.break_on_alarm = argument == "on"
                    pipe.send({"type": "notice", "text": f"break on alarm: {argument}"})
                elif word == "attention" and self.watcher is not None:
                    self.watcher.select_attention(int(argument))  # an int swap, read at the next step
                elif word in ("verify", "watch"):
                    self.requests.append((word, argument))
                elif word == "quit":
                    os.kill(os.getpid(), signal.SIGTERM)
                self._condition.notify_all()

        def before_forward(self, watcher) -> None:
            self.watcher = watcher
            with self._condition:
                self._serve(watcher)
                if self.paused and not self.allowed:
                    pipe.send({"type": "paused", "step": watcher.steps})
                while self.paused and not self.allowed:
                    self._condition.wait(0.5)
                    self._serve(watcher)
                if self.paused and self.allowed:
                    self.allowed -= 1

        def _serve(self, watcher) -> None:
            """Run requests in the program's thread, between two of its forwards (nothing else touches the cache)."""
            while self.requests:
                word, argument = self.requests.pop(0)
                if word == "watch":
                    token_id = int(argument)
                    watcher.watch_ids = watcher.watch_ids + (token_id,)
                    pipe.send({"type": "notice", "text": f"watching token {token_id} from the next step"})
                elif word == "verify":
                    try:
                        result = watcher.verify()
                        pipe.send({"type": "verify", "step": watcher.steps, **result})
                    except Exception as exc:  # noqa: BLE001  a refusal, said in one line
                        pipe.send({"type": "notice", "text": f"verify: {exc}", "severity": "error"})

        def after_step(self, watcher, snapshot) -> None:
            if self.break_on_alarm and any(d.severity in ("warning", "error") for d in snapshot.diagnostics):
                with self._condition:
                    self.paused = True
                    self.allowed = 0
                codes = sorted({d.code for d in snapshot.diagnostics if d.severity != "info"})
                pipe.send({"type": "break", "step": snapshot.step, "codes": codes})

    return ControlGate()


def child_main(argv: list[str] | None = None) -> int:
    """`python -m kvtui.engine.watch.child --records-fd W --control-fd R [--trace P] [--paused] [-m] TARGET ARGS...`"""
    import argparse

    parser = argparse.ArgumentParser(prog="kvtui-watch-child")
    parser.add_argument("--records-fd", type=int, required=True)
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--trace", default=None)
    parser.add_argument("--paused", action="store_true")
    parser.add_argument("--break-on-alarm", action="store_true")
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--attention", action="store_true")
    parser.add_argument("-m", dest="module", action="store_true")
    parser.add_argument("target")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)

    # the viewer's ctrl+c (interrupt()) is a KeyboardInterrupt in the program, as in a terminal, even when
    # kvtui itself was started with SIGINT ignored (a background job of a script, nohup)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    pipe = RecordPipe(options.records_fd)
    gate = control_gate(options.control_fd, pipe, options.paused, options.break_on_alarm)

    def make_watcher():  # when the program's imports reach transformers (deferred.py): torch is imported then
        from .probe import Watcher

        gate.watcher = Watcher(
            trace=options.trace,
            top_k=options.top_k,
            gate=gate,
            program=[options.target, *options.args],
            on_snapshot=pipe.send,
            on_event=pipe.send,
            attention=options.attention,
        )
        return gate.watcher

    code, watcher, _ = run_deferred(make_watcher, options.target, options.args, module=options.module)
    pipe.send({"type": "program-exit", "code": code, "steps": watcher.steps if watcher is not None else 0})
    pipe.close()
    return code


class ProgramSource(ChildSource):
    """Runs `kvtui watch`'s program in a child process; `records()` yields its records and output lines."""

    supports = {"pause", "run", "step", "break", "verify", "watch", "attention"}

    def __init__(
        self,
        target: str,
        args: list[str],
        module: bool = False,
        trace: str | os.PathLike | None = None,
        paused: bool = False,
        break_on_alarm: bool = False,
        top_k: int = 10,
        cwd: str | None = None,
        attention: bool = False,
    ):
        self.argv = [target, *args]
        command = ["--top-k", str(top_k)] + (["--attention"] if attention else [])
        if trace:
            command += ["--trace", str(Path(trace).resolve())]
        if paused:
            command.append("--paused")
        if break_on_alarm:
            command.append("--break-on-alarm")
        if module:
            command.append("-m")
        self._spawn("kvtui.engine.watch.child", [*command, "--", target, *args], cwd=cwd, interactive=True)


if __name__ == "__main__":
    sys.exit(child_main())

"""The one protocol between a source of steps and a viewer (no Textual, no Rich, no torch).

Three sources feed one viewer: kvtui's own chat (the engine process, host.py), a watched
program (`kvtui watch`, a child running it under the probe), and a trace still being written
(`kvtui replay --follow`). Records flow one way as JSON lines: the trace's own records (schema 1)
plus a few stream-only ones; commands flow the other way, one per line: a word, then optionally
one JSON value (`send {"text": "hi", "run": true}`, `rewind 1`, `watch 42`).

  source -> viewer   {"type": "header" | "model" | "step" | "diagnostic", ...}   (trace schema 1)
                     {"type": "output", "stream": "stdout" | "stderr", "text": ..., ["partial": true]}
                                                              (added by the parent) a line of the child's output;
                                                              `partial`: the line's unterminated tail so far (a
                                                              prompt like input("you> ") writes no newline), shown
                                                              as the current last line and replaced by the next
                                                              record of that stream; a "\r" keeps its last part
                     {"type": "output", "stream": "stdin", "text": ...}   (added by the parent, watch only) a
                                                              line the person sent to the program's stdin, in
                                                              order with its output (a terminal's echo): it ends
                                                              a pending partial line, which is not sent again
                     {"type": "process-exit", "code": N}      the child ended (added by the parent)
    watch only       {"type": "paused", "step": N}            the program waits before its next forward
                     {"type": "break", "step": N, "codes": [...]}  break-on-alarm stopped it after step N
                     {"type": "verify", "step": N, ...}       a verify result (as in traces)
                     {"type": "notice", "text": ...}          a one-line answer to a command
                     {"type": "program-exit", "code": N}      the program ended with exit code N
    engine only      {"type": "progress", "text", "fraction"}  loading (conversion, weights)
                     {"type": "ready", "description", "pid", ...facts}  the model is loaded
                     {"type": "load-failed", "error": ...}    one line saying why
                     {"type": "session", "running", "steps", "turn", "cache_length", ["messages",
                      "messages_from"], ["diagnostics", "diagnostics_from"]}  before each step record: the chat
                                                              around it, where it changed
                     {"type": "state", "done": COMMAND, "note", "severity", "error", "verify",
                      ["messages", "messages_from"], ["diagnostics", "diagnostics_from"], ...facts}
                                                              after each command (error: a worker-error)
                     A list is sent as what changed: `X_from: i` and `X`, the items from index i on (the
                     viewer keeps its first i); absent: unchanged. So a record's bytes follow what a step
                     changed, not the chat's length (ListChanges, ListCopy).
  viewer -> source
    watch            pause | run | step | break on | break off | verify | watch ID | quit
    engine           send {"text", "run"} | step | run | pause | stop | rewind N | rewind_to N |
                     force {"id", "run"} | verify | sampler {...} | reset | export | watch ID |
                     attention LAYER | restore {"tokens", "state"} | quit
    the program's stdin (watch only) is a pipe of its own, not a command: the viewer writes the person's lines
    there (`write_stdin`), closes it for EOF (`close_stdin`), and `interrupt()` sends SIGINT to the program's
    process group, as ctrl+c in a terminal does. kvtui's engine process reads no stdin (/dev/null).

A child notices its viewer is gone (quit, crash or SIGKILL) when its control pipe closes, and exits.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Protocol

COMMANDS = ("pause", "run", "step", "break on", "break off", "verify", "watch", "quit")
STREAM_ONLY = (
    "paused",
    "break",
    "notice",
    "program-exit",
    "output",
    "process-exit",
    "progress",
    "ready",
    "load-failed",
    "session",
    "state",
)


class Source(Protocol):
    """What a viewer reads and drives, whichever source it is: kvtui's engine process (host.py EngineSource),
    a watched program (ProgramSource) or a command's tree (tree_source.py TreeSource), a trace still being
    written (FollowSource). A watched program's source also takes the person's input: `write_stdin(text)`,
    `close_stdin()`, `interrupt()`."""

    supports: set[str]  # the command words it takes: the viewer enables a key by them

    def records(self, stop: threading.Event | None = None) -> Iterator[dict]:
        """Every record until the source ends (the last one `process-exit` for a process) or `stop` is set."""
        ...

    def command(self, word: str, argument: Any = None) -> None:
        """One command (a word of `supports`, its argument a JSON value); a source that ended ignores it."""
        ...

    def stop(self) -> None:
        """End it (a process and whatever it started) and remove what it left on disk; safe to call twice."""
        ...


def format_command(word: str, argument=None) -> str:
    """One command line: the word, then its argument as one JSON value (no newline inside)."""
    return word if argument is None else f"{word} {json.dumps(argument, ensure_ascii=False)}"


class ListChanges:
    """The sender's side of a list sent as its changes (see the module doc): what changed since the last send."""

    def __init__(self):
        self._sent: list = []

    def changes(self, now: list) -> tuple[int, list] | None:
        """(i, now[i:]) for the first i items the viewer already has; None when nothing changed."""
        same, shortest = 0, min(len(self._sent), len(now))
        while same < shortest and self._sent[same] == now[same]:
            same += 1
        if same == len(now) == len(self._sent):
            return None
        self._sent = [dict(item) if isinstance(item, dict) else item for item in now]  # items mutated in place
        return same, now[same:]

    def put(self, record: dict, key: str, now: list, always: bool = False) -> None:
        """Add `key` and `key_from` to the record when the list changed (or `always`: a state record)."""
        found = self.changes(now)
        if found is None and always:
            found = len(now), []
        if found is not None:
            record[f"{key}_from"], record[key] = found


class ListCopy:
    """The viewer's side: the list as the records built it."""

    def __init__(self):
        self.items: list = []

    def update(self, record: dict, key: str) -> list | None:
        """The whole list when this record changed it (a new list object), else None."""
        if key not in record:
            return None
        self.items = self.items[: record.get(f"{key}_from", 0)] + list(record[key])
        return self.items


def parse_command(line: str) -> tuple[str, Any]:  # the argument: a JSON value
    word, _, rest = line.strip().partition(" ")
    if not rest:
        return word, None
    try:
        return word, json.loads(rest)
    except ValueError:
        return word, rest  # a bare word argument ("break on")


class RecordPipe:
    """The child's end of the record stream: one JSON line per record, in the order sent, serialised by the
    sender (a step once, for the pipe and the trace) and written by a LineWriter's thread (a viewer that
    reads slowly never holds the program)."""

    def __init__(self, fd: int):
        from .trace import LineWriter

        self._writer = LineWriter(
            os.fdopen(fd, "wb", buffering=0), "kvtui-record-pipe", raise_errors=False, background=True
        )

    @property
    def closed(self) -> bool:
        return self._writer.error is not None

    def send(self, *records) -> None:
        """Records (dicts, or step snapshots) written in one go: the viewer's reader wakes once for all of them."""
        self._writer.put(*records)

    def close(self) -> None:
        self._writer.close()


# ---- the child: a gate the viewer controls --------------------------------------------------------


def control_gate(
    control_fd: int, pipe: RecordPipe, start_paused: bool = False, break_on_alarm: bool = False, on_gone=None
):
    """A probe Gate that holds the program before a forward while the viewer says pause. `on_gone()` runs
    when the viewer's end of the control channel closes (by default the process exits at once)."""
    from ..watch.probe import Gate

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
    """`python -m kvtui.engine.records.stream --records-fd W --control-fd R [--trace P] [--paused] [-m] TARGET ...`"""
    import argparse

    parser = argparse.ArgumentParser(prog="kvtui-watch-child")
    parser.add_argument("--records-fd", type=int, required=True)
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--trace", default=None)
    parser.add_argument("--paused", action="store_true")
    parser.add_argument("--break-on-alarm", action="store_true")
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("-m", dest="module", action="store_true")
    parser.add_argument("target")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)

    from ..watch.probe import Watcher, run_watched

    # the viewer's ctrl+c (interrupt()) is a KeyboardInterrupt in the program, as in a terminal, even when
    # kvtui itself was started with SIGINT ignored (a background job of a script, nohup)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    pipe = RecordPipe(options.records_fd)
    gate = control_gate(options.control_fd, pipe, options.paused, options.break_on_alarm)
    watcher = Watcher(
        trace=options.trace,
        top_k=options.top_k,
        gate=gate,
        program=[options.target, *options.args],
        on_snapshot=pipe.send,
        on_event=pipe.send,
    )
    code, _ = run_watched(watcher, options.target, options.args, module=options.module)
    pipe.send({"type": "program-exit", "code": code, "steps": watcher.steps})
    pipe.close()
    return code


# ---- the parent: a program as a source of records ----------------------------------------------------


class ChildSource:
    """A child process speaking this protocol: records on a pipe of their own, commands on another, its
    stdout/stderr lines as "output" records. It runs in a session of its own (a ctrl+c in the terminal
    is the viewer's to handle) and ends with the viewer: `stop()`, or the control pipe closing.
    With `interactive`, its stdin is a pipe the viewer writes the person's lines to; else /dev/null."""

    supports: set[str] = set()
    PARTIAL_QUIET = 0.05  # seconds without more output before an unterminated tail is shown as a partial line

    def _spawn(
        self, module: str, args: list[str], env: dict | None = None, cwd: str | None = None, interactive: bool = False
    ) -> None:
        """`python -m MODULE --records-fd W --control-fd R ARGS...`"""
        records_read, records_write = os.pipe()
        control_read, control_write = os.pipe()
        command = [
            sys.executable,
            "-m",
            module,
            "--records-fd",
            str(records_write),
            "--control-fd",
            str(control_read),
            *args,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        process = subprocess.Popen(
            command,
            pass_fds=(records_write, control_read),
            stdin=subprocess.PIPE if interactive else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        os.close(records_write)
        os.close(control_read)
        self._control = os.fdopen(control_write, "w", encoding="utf-8", buffering=1)
        self._control_lock = threading.Lock()
        self._read_process(process)
        threading.Thread(target=self._read_records, args=(records_read,), daemon=True).start()

    def _read_process(self, process: subprocess.Popen) -> None:
        """Its stdout/stderr as "output" records (two of the three streams `records()` waits for; the
        third, the records themselves, is the subclass's to read)."""
        self.process = process
        if process.stdin is not None:
            os.set_blocking(process.stdin.fileno(), False)  # a program that does not read never blocks the UI
        self._stdin_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        # the stdout/stderr bytes already shown as a partial line, per stream; an echo of a sent line ends them
        self._output_lock = threading.Lock()
        self._shown_partial: dict[str, int] = {}
        self._ended_partial: set[str] = set()
        self._open = 3
        for name, stream in (("stdout", process.stdout), ("stderr", process.stderr)):
            threading.Thread(target=self._read_output, args=(name, stream), daemon=True).start()

    def _read_records(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as records:
            for line in records:
                try:
                    self._queue.put(json.loads(line))
                except ValueError:
                    continue  # a line cut by a killed child
        self._queue.put(None)

    def _read_output(self, name: str, stream) -> None:
        """The child's output as "output" records: each line once complete, and an unterminated tail (a prompt,
        a progress bar) as a partial record once the child has written nothing more for PARTIAL_QUIET."""
        import select

        fd = stream.fileno()
        pending = b""  # bytes of the current line so far
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            with self._output_lock:
                if name in self._ended_partial:  # a sent line's echo ended the partial shown so far
                    self._ended_partial.discard(name)
                    pending = pending[self._shown_partial.pop(name, 0) :]
                if not chunk:
                    break
                *lines, pending = (pending + chunk).split(b"\n")
                for raw in lines:
                    self._queue.put({"type": "output", "stream": name, "text": _line_text(raw)})
                if lines:
                    self._shown_partial.pop(name, None)  # that line is complete: no partial of it is shown
                if not pending:
                    continue
                if select.select([fd], [], [], self.PARTIAL_QUIET)[0]:
                    continue  # more is coming at once: the line is still being written
                self._queue.put(
                    {"type": "output", "stream": name, "text": _line_text(pending, partial=True), "partial": True}
                )
                self._shown_partial[name] = len(pending)
        if pending:  # the child ended mid-line: the tail is its last line
            self._queue.put({"type": "output", "stream": name, "text": _line_text(pending)})
        stream.close()
        self._queue.put(None)

    def records(self, stop: threading.Event | None = None) -> Iterator[dict]:
        """Every record until the child and its pipes are done (or `stop` is set)."""
        while self._open:
            if stop is not None and stop.is_set():
                return
            try:
                record = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            if record is None:
                self._open -= 1
                continue
            yield record
        code = self.process.wait()
        yield {"type": "process-exit", "code": code}

    def command(self, word: str, argument=None) -> None:
        self.send(format_command(word, argument))

    def send(self, line: str) -> None:
        """One command line, as format_command wrote it."""
        try:
            with self._control_lock:
                self._control.write(line + "\n")
        except (BrokenPipeError, OSError, ValueError):
            pass  # the child is gone: nothing to control

    # ---- the program's stdin (interactive children only) ----------------------------------------------

    @property
    def stdin_open(self) -> bool:
        return self._stdin() is not None

    def _stdin(self) -> IO[bytes] | None:
        """The program's stdin while it is open."""
        stdin = getattr(self.process, "stdin", None)
        return stdin if stdin is not None and not stdin.closed else None

    def write_stdin(self, text: str) -> bool:
        """Send text (a line ends with "\n") to the program's stdin, and echo it (without the newline) as an
        "output" record of stream "stdin", in order with the program's output. False (nothing sent) when its
        stdin is closed, the program is gone, or it has not read the last 64 KiB it was sent."""
        stdin = self._stdin()
        if stdin is None:
            return False
        data = text.encode("utf-8")
        # the output lock is held while the line goes out: whatever the program answers is read after the echo
        with self._stdin_lock, self._output_lock:
            try:
                written = os.write(stdin.fileno(), data)
            except (BlockingIOError, BrokenPipeError, OSError, ValueError):
                return False
            deadline = time.monotonic() + 1.0
            while written < len(data):  # the pipe was nearly full: finish the line, briefly
                if time.monotonic() > deadline:
                    return False
                try:
                    written += os.write(stdin.fileno(), data[written:])
                except BlockingIOError:
                    time.sleep(0.01)
                except (BrokenPipeError, OSError, ValueError):
                    return False
            self._ended_partial.update(self._shown_partial)  # as a terminal's echo ends the prompt's line
            self._queue.put({"type": "output", "stream": "stdin", "text": text.rstrip("\n")})
        return True

    def close_stdin(self) -> None:
        """End the program's input (EOF: its input() raises EOFError, a read returns b"")."""
        stdin = self._stdin()
        if stdin is not None:
            with self._stdin_lock:
                try:
                    stdin.close()
                except OSError:
                    pass

    def interrupt(self) -> bool:
        """SIGINT to the program's process group, as ctrl+c in its terminal would (a KeyboardInterrupt in
        Python). False when it has ended."""
        if self.process.poll() is not None:
            return False
        try:
            os.killpg(self.process.pid, signal.SIGINT)
        except ProcessLookupError:
            return False
        return True

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace: float = 2.0) -> None:
        """End the child and everything it started: close the control pipe, then TERM, then KILL."""
        self.close_stdin()
        try:
            with self._control_lock:
                self._control.close()
        except OSError:
            pass
        self._end_group(grace)

    def _end_group(self, grace: float) -> None:
        """Give the child `grace` seconds to end by itself, then TERM, then KILL its process group."""
        for sig, wait in ((None, grace), (signal.SIGTERM, grace), (signal.SIGKILL, grace)):
            if sig is not None:
                try:
                    os.killpg(self.process.pid, sig)
                except ProcessLookupError:
                    return
            try:
                self.process.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


class ProgramSource(ChildSource):
    """Runs `kvtui watch`'s program in a child process; `records()` yields its records and output lines."""

    supports = {"pause", "run", "step", "break", "verify", "watch"}

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
    ):
        self.argv = [target, *args]
        command = ["--top-k", str(top_k)]
        if trace:
            command += ["--trace", str(Path(trace).resolve())]
        if paused:
            command.append("--paused")
        if break_on_alarm:
            command.append("--break-on-alarm")
        if module:
            command.append("-m")
        self._spawn("kvtui.engine.records.stream", [*command, "--", target, *args], cwd=cwd, interactive=True)


def _line_text(raw: bytes, partial: bool = False) -> str:
    """One output line as text: a progress bar's last state ("\r" rewrites it), no line ending; a partial
    line's cut multi-byte character is left for the line's next record."""
    if partial:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            if exc.reason == "unexpected end of data":
                raw = raw[: exc.start]
    text = raw.decode("utf-8", "replace").rstrip("\r\n")
    return next((part for part in reversed(text.split("\r")) if part), "")


ENGINE_SPIN_COUNT = 1000  # libgomp spins of a waiting OpenMP thread before it sleeps, in the engine process


def openmp_wait(environ=os.environ) -> dict:
    """How the engine's OpenMP threads wait between parallel regions (libgomp, the runtime of torch's Linux
    CPU wheels). Its default spins about 300,000 times before sleeping, which keeps every core busy between
    forwards: the app's repaints then preempt a spinning thread and the whole team waits for it. Sleeping at
    once (OMP_WAIT_POLICY=PASSIVE) pays a wake-up at each of the hundreds of parallel regions of a forward.
    A short spin bridges the gaps between the regions of one forward and sleeps between forwards (make bench,
    section 4, runs the three side by side). A user's own setting wins."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return {}
    return {"GOMP_SPINCOUNT": str(ENGINE_SPIN_COUNT)}


class FollowSource:
    """A trace file that another process is still writing (`kvtui replay --follow`): its records, then
    new ones as they are appended. Read-only: it takes no commands."""

    supports: set[str] = set()

    def __init__(self, path: str | os.PathLike, poll: float = 0.2):
        self.path, self.poll = Path(path), poll

    def records(self, stop: threading.Event | None = None) -> Iterator[dict]:
        from .trace import TraceError

        try:
            handle = open(self.path, "rb")
        except OSError as exc:
            raise TraceError(f"{self.path}: cannot read: {exc.strerror or exc}") from None
        with handle:
            pending = b""
            number = 0
            while not (stop is not None and stop.is_set()):
                chunk = handle.readline()
                if not chunk:
                    time.sleep(self.poll)
                    continue
                pending += chunk
                if not pending.endswith(b"\n"):  # the writer is mid-line: wait for the rest
                    continue
                line, pending = pending, b""
                number += 1
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    raise TraceError(f"{self.path}:{number}: not valid JSON") from None
                if isinstance(record, dict) and "type" in record:
                    yield record

    def command(self, word: str, argument=None) -> None:
        pass  # read-only (supports nothing: the viewer sends nothing)

    def stop(self) -> None:
        pass


if __name__ == "__main__":
    sys.exit(child_main())

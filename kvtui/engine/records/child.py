"""A child process that speaks the stream protocol, seen from its parent: spawning it, reading its records and
output lines, its stdin, ending its process group; and the OpenMP waiting policy its threads get."""

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
from typing import IO

from .stream import format_command


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

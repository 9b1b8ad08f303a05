"""`kvtui attach`'s reader in a process of its own, for the TUI: the AttachSession (ZeroMQ SUB, decode, index
apply, /metrics, the trace) runs in a child process, and the screen asks it over a pipe for the same frozen values
it reads from a cache in this process (view.py: a bounded frame, a block's detail, a note's target).

Why: in one interpreter the screen's repaints and the reader take turns on the GIL (the reader had to yield 2 ms
after every 5 ms of applying so keys stayed quick), so a saturated reader lost a share of its time to the
screen. In its own process it needs no yield and takes a core where one is free; the screen only unpickles a
bounded frame (about 66 kB, 1 ms) 4 times a second. What one reader sustains is then set by its own cost per
event (benchmarks/RESULTS.md section 10).

The child writes the trace, so it holds the same records as `--headless` (one AttachSession either way). One
request is in flight at a time: the next frame is asked ahead, so a refresh takes what the child built meanwhile;
an answer that comes after the screen gave up waiting is dropped (that refresh is skipped, as when the reader held
the lock). The child ends on `stop` (quit), or when the screen's process is gone
(its end of the pipe closes); Ctrl-C is the screen's, so the child ignores SIGINT.
"""

from __future__ import annotations

import multiprocessing
import pickle
import signal
import threading
from collections import deque
from collections.abc import Iterable
from typing import Any

from ..records.snapshot import Diagnostic
from .attach import AttachOptions, AttachSession, Outage, title_of
from .server_http import EventEndpoint, ServerInfo
from .subscriber import Problem
from .view import (
    NOTES_SHOWN,
    BlockInfo,
    Frame,
    Frames,
    NodeRef,
    StatsView,
    TextsView,
    read_block_info,
    read_frame,
    read_note_target,
    stats_view,
)

START_WAIT_S = 60.0  # the child imports the reader and connects (a spawn: a fresh interpreter)
ANSWER_WAIT_S = 0.25  # the longest the screen waits for an answer (one refresh at 4 Hz); past it, skipped
CHILD_LOCK_S = 0.2  # the longest the child waits for its reader thread to let the cache go
STOP_WAIT_S = 10.0  # the child stops its reader and closes the trace, then ends; past this it is terminated
PROBLEMS_KEPT = 200


class ReaderProcess:
    """An AttachSession in a child process; what the server screen reads of it comes over a pipe."""

    def __init__(self, options: AttachOptions, servers: list[ServerInfo]):
        self.options = options
        self.servers = servers
        self.endpoints: list[EventEndpoint] = [e for s in servers for e in s.endpoints]
        self.problems: deque[Problem] = deque(maxlen=PROBLEMS_KEPT)
        self.error: str | None = None  # the child's reader stopped on this
        self.answers = 0  # answers received (a benchmark counts them)
        self._outages: list[Outage] = []
        self._reading = False
        self._process: Any = None
        self._conn: Any = None
        self._call = 0
        self._pending: int | None = None  # a request whose answer has not come yet
        self._ahead: tuple | None = None  # the arguments of the frame asked ahead
        self._lock = threading.Lock()  # one request in flight

    @property
    def title(self) -> str:
        return title_of(self.servers, self.endpoints)

    @property
    def frames(self) -> Frames:
        return self  # (typed as the contract: mypy checks this class keeps view.Frames)

    def start(self, duration: float | None = None, wait: float = START_WAIT_S) -> None:
        """Start the child and wait until its reader has subscribed (raises what building the session raised)."""
        context = multiprocessing.get_context("spawn")  # no fork: the parent may hold threads and a ZeroMQ context
        ours, theirs = context.Pipe()
        self._process = context.Process(
            target=_serve, args=(theirs, self.options, self.servers, duration), name="kvtui-kv-events", daemon=True
        )
        self._process.start()
        theirs.close()
        self._conn = ours
        if not ours.poll(wait):
            self._end()
            raise RuntimeError(f"the event reader did not start in {wait:.0f} s")
        try:
            kind, detail = ours.recv()
        except EOFError:
            self._end()
            raise RuntimeError("the event reader ended as it started") from None
        if kind == "failed":
            self._end()
            raise detail
        self._reading = True

    # ---- the screen's reads (view.Frames, as CacheFrames answers them in-process; the timeouts the pipe's) ----------

    def read_frame(
        self,
        expanded: Iterable[int],
        pinned: Iterable[int],
        selected: NodeRef | None,
        notes_from: int,
        last: tuple | None,
        timeout: float,
        force: bool = False,
        notes_max: int = NOTES_SHOWN,
    ) -> Frame | None:
        """The frame the screen asks for. The child builds the next one while the screen draws this one (asked
        ahead with what the screen will ask next), so a refresh only takes what is there and never waits on the
        pipe; a forced frame (a chain expanded, a note chosen), or one asked with other arguments, is asked and
        waited for (ANSWER_WAIT_S at most)."""
        args = (frozenset(expanded), frozenset(pinned), selected, notes_from, last, force, notes_max)
        with self._lock:
            try:
                if not force and self._pending is not None and self._ahead == args:
                    answer = self._receive(self._pending, 0.0)  # built meanwhile, or skipped this time
                else:
                    answer = self._request("frame", args)
                if answer is None or isinstance(answer, TimeoutError):
                    return None
                frame = answer
                if frame.view is not None:  # what the screen keeps of it, as it will ask next
                    args = (args[0], args[1], selected, frame.total_notes, frame.signature, False, notes_max)
                else:
                    args = (*args[:5], False, notes_max)
                self._ahead = args
                self._send("frame", args)
                return frame
            except (EOFError, OSError):  # the child is gone (it said why in its last answer, if it could)
                self._reading = False
                return None

    def read_block_info(self, ref: NodeRef | None, timeout: float) -> tuple[BlockInfo | None, TextsView]:
        return self._must("block", ref)

    def read_note_target(self, note: Diagnostic, timeout: float) -> NodeRef | None:
        return self._must("note", note)

    def stats(self) -> StatsView | None:
        """The numbers alone (None: the child did not answer in time)."""
        answer = self._ask("stats", None)
        return None if answer is None or isinstance(answer, TimeoutError) else answer

    def unreachable(self) -> list[Outage]:
        return list(self._outages)

    @property
    def running(self) -> bool:
        return self._reading and self._process is not None and self._process.is_alive()

    def stop(self) -> None:
        """The child stops its reader (its sockets, its trace) and ends; the server is not kvtui's. Idempotent."""
        with self._lock:
            if self._conn is not None and self._process is not None and self._process.is_alive():
                try:
                    self._conn.send((0, "stop", None))
                except OSError:
                    pass  # it ended already
            self._end()

    def _end(self) -> None:
        self._reading = False
        if self._process is not None:
            self._process.join(STOP_WAIT_S)
            if self._process.is_alive():
                self._process.terminate()
                self._process.join(5)
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # ---- the pipe ------------------------------------------------------------------------------------

    def _must(self, kind: str, args: Any) -> Any:
        answer = self._ask(kind, args)
        if answer is None:
            raise TimeoutError("the event reader did not answer in time")
        if isinstance(answer, TimeoutError):
            raise answer
        return answer

    def _ask(self, kind: str, args: Any) -> Any:
        """Send one request and wait ANSWER_WAIT_S for its answer: the answer, or None (none in time, or the
        child is gone)."""
        with self._lock:
            try:
                return self._request(kind, args)
            except (EOFError, OSError):  # the child is gone (it said why in its last answer, if it could)
                self._reading = False
                return None

    def _request(self, kind: str, args: Any) -> Any:
        if self._conn is None:
            return None
        if self._pending is not None:  # an answer still owed (a frame asked ahead): taken and dropped
            if self._receive(self._pending, ANSWER_WAIT_S) is None and self._pending is not None:
                return None  # the child is busy: this read is skipped
        self._send(kind, args)
        return self._receive(self._call, ANSWER_WAIT_S)

    def _send(self, kind: str, args: Any) -> None:
        if self._conn is None:
            raise EOFError
        self._call += 1
        self._pending = self._call
        self._conn.send((self._call, kind, args))

    def _receive(self, call: int, wait: float) -> Any:
        """The answer to request `call` (None: not in `wait` seconds). Answers to earlier requests are dropped."""
        if self._conn is None:
            raise EOFError
        while self._conn.poll(wait):
            number, answer, problems, outages, error, reading = self._conn.recv()
            self.answers += 1
            self.problems.extend(problems)
            self._outages, self._reading = outages, reading
            if error is not None:
                self.error = error
            if number == call:
                self._pending = None
                return answer
        return None


def _serve(conn, options: AttachOptions, servers: list[ServerInfo], duration: float | None) -> None:
    """The child: an AttachSession read on its threads; this thread answers the screen's requests."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the screen's: quitting stops this through the pipe
    try:
        session = AttachSession(options, servers)
    except Exception as error:  # noqa: BLE001  (the screen's process raises it: a trace path that cannot be opened)
        conn.send(("failed", _portable(error)))
        return
    outbox: deque[Problem] = deque(maxlen=PROBLEMS_KEPT)  # problems since the last answer (appended on threads)
    session.on_problem.append(outbox.append)
    subscriber = session.subscriber
    try:
        session.start(duration)
        conn.send(("ready", None))
        while True:
            try:
                number, kind, args = conn.recv()
            except EOFError:
                break  # the screen's process is gone
            if kind == "stop":
                break
            subscriber.viewer_waits.set()  # the reader yields after each budget, so the lock comes quickly
            try:
                answer = _answer(session, kind, args)
            finally:
                subscriber.viewer_waits.clear()
            problems = []
            while outbox:
                problems.append(outbox.popleft())
            stopped = None if session.error is None else f"{type(session.error).__name__}: {session.error}"
            conn.send((number, answer, problems, session.unreachable(), stopped, session.running))
    except (BrokenPipeError, ConnectionResetError):
        pass  # the screen's process is gone
    finally:
        session.stop()
        conn.close()


def _answer(session: AttachSession, kind: str, args: Any) -> Any:
    cache = session.cache
    try:
        if kind == "frame":
            expanded, pinned, selected, notes_from, last, force, notes_max = args
            frame = read_frame(cache, expanded, pinned, selected, notes_from, last, CHILD_LOCK_S, force, notes_max)
            return TimeoutError("the event reader holds the cache") if frame is None else frame
        if kind == "block":
            return read_block_info(cache, args, CHILD_LOCK_S)
        if kind == "note":
            return read_note_target(cache, args, CHILD_LOCK_S)
        if kind == "stats":
            if not cache.lock.acquire(timeout=CHILD_LOCK_S):
                return TimeoutError("the event reader holds the cache")
            try:
                return stats_view(cache)
            finally:
                cache.lock.release()
    except TimeoutError as error:
        return error
    raise ValueError(f"unknown request {kind!r}")


def _portable(error: BaseException) -> BaseException:
    """The error as it pickles (an exception with other arguments than its message may not)."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(error).__name__}: {error}")

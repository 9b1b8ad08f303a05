"""The engine process: kvtui's own chat (ChatSession and its Recorder) in a child of the viewer, so the
app's repaints never take the interpreter lock the model's forward needs. Both of its sides live here: the
EngineSource a viewer starts (spawn, handover of the setup and a loaded model, restart, clean-up) and the
EngineHost that runs in the child.

`python -m kvtui.engine.chat.host --records-fd W --control-fd R --setup FILE` (EngineSource starts it; the
records and commands are stream.py's protocol).

Threads: the main thread runs one command at a time and is the only one to touch the session. The
control thread reads commands: `pause`/`stop` cancel a running turn at once, `attention` is an int
swap, `watch` waits for the main thread (between two forwards); every other command queues and
cancels a turn still running, as a new key did in the app. When the control pipe closes (the app
quit, crashed or was SIGKILLed) the engine lets its forward end, closes the trace and exits; after
EXIT_GRACE seconds it exits regardless.
"""

from __future__ import annotations

import argparse
import os
import pickle
import queue
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..records.child import ChildSource, openmp_wait
from ..records.codec import from_record, to_record
from ..records.snapshot import BufferToken
from ..records.stream import ListChanges, RecordPipe, parse_command

if TYPE_CHECKING:
    from ..records.recorder import Recorder
    from .loader import LoadedModel
    from .session import ChatSession

EXIT_GRACE = 1.5  # seconds a forward may take to end once the app is gone
MESSAGES_HZ = 2  # transcript updates per second while a turn runs: decoding the reply is O(reply)
ACTIONS = ("send", "step", "run", "rewind", "rewind_to", "force", "verify", "sampler", "reset", "export", "restore")


@dataclass
class EngineSetup:
    """What the app hands the engine process (pickled into a private file). Only plain values unless the
    app itself was given objects: a loaded model, a loader, a clock, a setup hook (they must pickle)."""

    model: str | None
    options: dict  # complete: every option, the defaults merged in (kvtui.options.AppConfig(options=...).options)
    trace_path: str | None
    verify_every: int = 0
    loaded: LoadedModel | None = None  # a model the app was given instead of a model name
    loader: Callable | None = None  # called instead of loading `model` (returns a LoadedModel)
    clock: Callable[[], float] | None = None  # the session's clock (tests: deterministic timings)
    engine_setup: Callable | None = None  # called with the session once it exists (patch the model, inject faults)
    append: bool = False  # a restarted engine goes on with the trace its predecessor wrote
    spool: bool = False  # trace_path is a spool its source made: removed when the engine ends with its viewer


def write_setup(setup: EngineSetup, path: str | os.PathLike, scratch: str | os.PathLike | None = None) -> None:
    """Pickle the setup for the engine process. A loaded model that does not pickle (transformers leaves
    local-function hooks on a model once it captured outputs; a user's model may hold anything) is handed
    over through `save_pretrained` into `scratch` instead, and the engine loads it back from there."""
    try:
        data = pickle.dumps(setup, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError):
        if setup.loaded is None or scratch is None:
            raise
        data = pickle.dumps(_saved(setup, Path(scratch)), protocol=pickle.HIGHEST_PROTOCOL)
    with open(path, "wb") as handle:
        handle.write(data)


def _saved(setup: EngineSetup, scratch: Path) -> EngineSetup:
    from dataclasses import replace
    from functools import partial

    loaded = setup.loaded
    assert loaded is not None  # only a loaded model is handed over this way
    scratch.mkdir(parents=True, exist_ok=True)
    loaded.model.save_pretrained(scratch)
    loaded.tokenizer.save_pretrained(scratch)
    attention = getattr(loaded.model.config, "_attn_implementation", None)
    return replace(
        setup,
        loaded=None,
        loader=partial(load_saved, str(scratch), loaded.source, loaded.path, loaded.dtype, loaded.device, attention),
    )


def load_saved(directory: str, source: str, path: str, dtype: str, device: str, attention: str | None):
    """The engine's loader for a model handed over with save_pretrained: same names, dtype, device, attention."""
    from dataclasses import replace

    from .loader import load_model

    loaded = load_model(directory, dtype=dtype, device=device, attn_implementation=attention)
    return replace(loaded, source=source, path=path)


class EngineSource(ChildSource):
    """kvtui's own chat in an engine process (EngineHost below), started from an EngineSetup: one source per
    process; `restarted()` starts the next one after it died. It owns the handover's files in a private
    directory removed at stop(): the pickled setup, the save_pretrained files of a loaded model that does
    not pickle, and the trace spool when the setup names no trace (ctrl+s copies it; a restarted engine
    appends to it). The child gets this process's import path, so whatever the setup names (a loader, a
    hook) imports there."""

    supports = {
        "send",
        "step",
        "run",
        "pause",
        "stop",
        "rewind",
        "rewind_to",
        "force",
        "verify",
        "sampler",
        "reset",
        "export",
        "watch",
        "attention",
        "restore",
    }

    def __init__(self, setup: EngineSetup, restore: dict | None = None, *, spool: Path | None = None):
        """`restore`: a chat to rebuild as soon as the model is loaded (a restart); `spool`: the directory of a
        spooled trace this source takes over from its predecessor."""
        self.directory = Path(tempfile.mkdtemp(prefix="kvtui-engine-"))
        self._spool = spool
        try:
            if setup.trace_path is None:
                self._spool = Path(tempfile.mkdtemp(prefix="kvtui-spool-"))
                setup = replace(setup, trace_path=str(self._spool / "session.jsonl"), spool=True)
            self.setup = setup
            setup_path = self.directory / "setup.pickle"
            write_setup(setup, setup_path, self.directory / "handover")
            path = os.pathsep.join(entry or os.getcwd() for entry in sys.path)
            env = {"PYTHONPATH": path, **openmp_wait()}
            self._spawn("kvtui.engine.chat.host", ["--setup", str(setup_path)], env=env)
        except BaseException:  # a model that neither pickles nor saves, a full disk: nothing left behind
            self._remove_files()
            raise
        if restore is not None:
            self.command("restore", restore)  # runs as soon as the model is loaded

    @property
    def trace_path(self) -> Path:
        """The trace this engine writes (the spool when the setup named none)."""
        return Path(self.setup.trace_path or "")  # set in __init__ (the spool when the setup named none)

    @property
    def spooled(self) -> bool:
        return self._spool is not None

    def restarted(self, restore: dict | None = None) -> EngineSource:
        """A fresh engine process in place of this one (which has ended): same setup, appending to the same
        trace, `restore` fed into its new cache in one forward."""
        spool, self._spool = self._spool, None  # the spool goes on with the next engine
        self.stop()
        return EngineSource(replace(self.setup, append=True), restore, spool=spool)

    def stop(self, grace: float = 2.0) -> None:
        """End the engine (it closes its trace first, unless it is gone already), then remove its files."""
        if hasattr(self, "process"):
            super().stop(grace)
        self._remove_files()

    def _remove_files(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
        if self._spool is not None:
            shutil.rmtree(self._spool, ignore_errors=True)


class EngineHost:
    def __init__(self, pipe: RecordPipe, setup_path: str):
        self.pipe = pipe
        self.setup_path = setup_path
        self.setup: EngineSetup | None = None
        # None until load() sets it: the main thread runs no command before, the control thread checks
        self.session: ChatSession = None  # type: ignore[assignment]
        self.recorder: Recorder | None = None
        self.running = False
        self.commands: queue.Queue = queue.Queue()
        self._live: list[threading.Event] = []  # one per command received and not finished: set = cancel
        self._lock = threading.Lock()
        self._asides: list[int] = []  # watch requests, applied by the main thread between forwards
        self._messages_at = 0.0
        self._messages = ListChanges()  # the chat and the alarms go to the app as what changed
        self._diagnostics = ListChanges()
        self._diagnostics_count = -1

    # ---- the control thread ------------------------------------------------------------------------

    def read_commands(self, fd: int) -> None:
        with os.fdopen(fd, "r", encoding="utf-8") as lines:
            for line in lines:
                word, argument = parse_command(line)
                if word in ("pause", "stop"):
                    self._cancel_all()
                elif word == "attention":
                    if self.session is not None:
                        self.session.attention_layer = int(argument)  # an int swap, read at the next forward
                elif word == "watch":
                    self._asides.append(int(argument))
                elif word == "quit":
                    break
                elif word in ACTIONS:
                    cancel = threading.Event()
                    with self._lock:
                        for event in self._live:  # a new action ends a running turn, as a new key does
                            event.set()
                        self._live.append(cancel)
                    self.commands.put((word, argument, cancel))
                else:
                    self.pipe.send({"type": "notice", "text": f"unknown command {word!r}", "severity": "error"})
        # the app is gone (quit, crash or SIGKILL): end the turn, close the trace, go
        self._cancel_all()
        self.commands.put(("quit", None, threading.Event()))
        time.sleep(EXIT_GRACE)
        self.leave()
        os._exit(0)  # a forward that did not end in time (a long prefill) is not waited for

    def forget_setup(self) -> None:
        """Once loaded, the setup's files are read: removed here, so that a viewer killed with SIGKILL (which
        cannot clean up) leaves nothing behind. The directory is its EngineSource's, made for this engine."""
        setup_file = Path(self.setup_path)
        setup_file.unlink(missing_ok=True)
        shutil.rmtree(setup_file.parent / "handover", ignore_errors=True)  # mapped weights stay readable
        try:
            setup_file.parent.rmdir()  # only when nothing else is in it
        except OSError:
            pass

    def leave(self) -> None:
        """The viewer is gone: a spool (a trace nobody asked for) goes with the engine."""
        if self.setup is not None and self.setup.spool and self.setup.trace_path:
            shutil.rmtree(Path(self.setup.trace_path).parent, ignore_errors=True)

    def _cancel_all(self) -> None:
        with self._lock:
            for event in self._live:
                event.set()

    # ---- loading -----------------------------------------------------------------------------------

    def load(self) -> bool:
        import torch

        from ..reading import introspect
        from ..records.recorder import Recorder
        from .configure import load, prepare_cache_backend, session_config, set_threads
        from .session import ChatSession

        progress = lambda text, fraction=None: self.pipe.send(  # noqa: E731
            {"type": "progress", "text": text, "fraction": fraction}
        )
        try:
            progress("starting the engine process")
            with open(self.setup_path, "rb") as handle:
                setup: EngineSetup = pickle.load(handle)
            self.setup = setup
            if setup.loaded is not None:
                set_threads(setup.options)  # before the first forward, as load() does
                loaded = setup.loaded
            elif setup.loader is not None:
                set_threads(setup.options)
                loaded = setup.loader()
            else:
                loaded = load(setup.model, setup.options, progress=progress)  # sets the threads first
            config = session_config(setup.options, loaded.tokenizer)
            extra = {"clock": setup.clock} if setup.clock else {}
            session = ChatSession(loaded.model, loaded.tokenizer, config, on_snapshot=self.on_snapshot, **extra)
            prepare_cache_backend(session.config, loaded.device, progress)
            self.recorder = Recorder(
                session,
                setup.trace_path,
                model_source=loaded.source,
                model_path=loaded.path,
                verify_every=setup.verify_every,
                append=setup.append,
            )
            if setup.engine_setup is not None:
                setup.engine_setup(session)
        except Exception as exc:  # noqa: BLE001  every load error, said in one line: the app shows it and stays open
            from ..records.trace import TraceError
            from .loader import ModelLoadError
            from .session import SessionError

            known = isinstance(exc, (ModelLoadError, SessionError, TraceError, ValueError))
            self.pipe.send({"type": "load-failed", "error": str(exc) if known else f"{type(exc).__name__}: {exc}"})
            return False
        self.session = session
        query, kv = introspect.attention_heads(loaded.model.config)
        capacity = f" {session.capacity}" if session.capacity else ""
        decode, every = config.decode_threads, torch.get_num_threads()
        threads = f" · decode on {decode} of {every} threads" if decode and decode != every else ""
        # most telling first: a narrow status line drops the parts at the end (the class, the threads)
        head = f"{loaded.source} · {loaded.device} · {loaded.dtype} · {session.config.cache}{capacity} cache"
        if session.config.press:
            head += f" · press {session.config.press}"
        tail = f" · {type(loaded.model).__name__}{threads}"
        self.pipe.send(
            {
                "type": "ready",
                "pid": os.getpid(),
                "description": f"{head} · {session.config.sampler.describe()}{tail}",
                # the parts around the sampler: the app says a sampler changed with `o` (remote.py)
                "description_parts": [head, tail],
                "query_heads": query,
                "kv_heads": kv,
                **self._facts(),
            }
        )
        return True

    # ---- the main thread: one command at a time ----------------------------------------------------

    def serve(self) -> None:
        while True:
            word, argument, cancel = self.commands.get()
            if word == "quit":
                break
            try:
                self._apply_asides()
                self.state(word, *self.execute(word, argument, cancel))
            except Exception as exc:  # noqa: BLE001  every failure is said; the session stays as it was
                from ..reading.export import ExportError
                from .session import SessionError

                if isinstance(exc, (SessionError, ExportError)):
                    self.state(word, str(exc), "error")
                else:  # a bug or a broken model: the app shows a worker-error alarm
                    self.state(word, error=f"{type(exc).__name__}: {exc}")
            finally:
                self.running = False
                with self._lock:
                    self._live.remove(cancel)
        self.close()

    def execute(self, word: str, argument, cancel: threading.Event) -> tuple[str, str, object]:
        """Run one command; returns (note, severity, verify result)."""
        session = self.session
        if word == "send":
            session.send(argument["text"])
            if argument.get("run"):
                self._run(cancel)
        elif word == "step":
            session.step()
        elif word == "run":
            self._run(cancel)
        elif word in ("rewind", "rewind_to"):
            snapshot = session.rewind(int(argument)) if word == "rewind" else session.rewind_to(int(argument))
            if snapshot is None:
                return "cache empty", "information", None
        elif word == "force":
            token = session.force(int(argument["id"]))
            session.step()
            if argument.get("run"):
                self._run(cancel)
            return f"forced {token.text!r} (id {token.id}, rank {token.rank})", "information", None
        elif word == "verify":
            from ...fmt import quantization_text

            result = session.verify()
            if result.compressed_kl is not None:  # --press: what the compression cost, not a match
                return (
                    f"compressed cache (--press {session.config.press}) against the uncompressed recompute of "
                    f"{result.tokens} tokens: top-1 {'agrees' if result.compressed_top1 else 'differs'}, "
                    f"KL(full ‖ compressed) {result.compressed_kl:.4g} nats · {result.ms:.0f} ms",
                    "information",
                    result,
                )
            verdict = "matches" if result.ok else "DIFFERS FROM"
            return (
                f"cache {verdict} a full recompute of {result.tokens} tokens: max |diff| {result.max_abs_diff:.2e} "
                f"(tolerance {result.tolerance:g}), top-k {'agrees' if result.topk_agree else 'differs'}"
                f"{quantization_text(result.layer_errors)} · {result.ms:.0f} ms",
                "information" if result.ok else "error",
                result,
            )
        elif word == "sampler":
            from .settings import SamplerSettings

            settings = SamplerSettings(**argument)
            session.set_sampler(settings)
            return f"sampler: {settings.describe()}", "information", None
        elif word == "reset":
            session.reset()
            return "cache and chat reset", "information", None
        elif word == "export":
            from ..reading.export import export_cache

            path = export_cache(session, Path.cwd() / f"kvtui-cache-step{session.steps}.safetensors")
            return (
                f"cache at step {session.steps} exported to {path} "
                "(kvtui.engine.reading.export.load_cache reads it back)",
                "information",
                None,
            )
        elif word == "restore":
            tokens = [from_record(BufferToken, t) for t in argument["tokens"]]
            session.restore(tokens, argument["state"])
            return (
                f"engine restarted: the cache was rebuilt from {len(tokens)} tokens in one forward (v verifies it)",
                "information",
                None,
            )
        return "", "information", None

    def _run(self, cancel: threading.Event) -> None:
        self.running = True
        self.session.generate(cancel=cancel)

    def _apply_asides(self) -> None:
        while self._asides:
            self.session.watch_token(self._asides.pop(0))  # recorded by the recorder, in this thread

    # ---- records -----------------------------------------------------------------------------------

    def on_snapshot(self, snapshot) -> None:
        """After every forward (main thread): the session's state, then the step record itself."""
        session = self.session
        now = time.monotonic()
        record = {
            "type": "session",
            "running": self.running,
            "steps": session.steps,
            "turn": session.turn,
            "cache_length": snapshot.cache_seq_length,
        }
        if not self.running or snapshot.phase != "decode" or now - self._messages_at >= 1 / MESSAGES_HZ:
            self._messages.put(record, "messages", session.messages)
            self._messages_at = now
        if len(session.diagnostics) != self._diagnostics_count:  # a step only adds alarms: O(1) when none
            self._diagnostics.put(record, "diagnostics", _diagnostics(session.diagnostics))
            self._diagnostics_count = len(session.diagnostics)
        self.pipe.send(record, snapshot)  # one write per step: one wake-up of the app's reader
        self._apply_asides()

    def state(self, done: str, note: str = "", severity: str = "information", verify=None, error: str | None = None):
        """After every command: what the app shows between turns (and that the command is done)."""
        session = self.session
        record = {
            "type": "state",
            "done": done,
            "note": note,
            "severity": severity,
            "error": error,
            "verify": to_record(verify) if verify is not None else None,
            **self._facts(),
        }
        self._messages.put(record, "messages", session.messages, always=True)
        self._diagnostics.put(record, "diagnostics", _diagnostics(session.diagnostics), always=True)
        self._diagnostics_count = len(session.diagnostics)
        self.pipe.send(record)

    def _facts(self) -> dict:
        session = self.session
        return {
            "steps": session.steps,
            "turn": session.turn,
            "cache_length": session.cache_length,
            "buffer_length": len(session.buffer),
            "capacity": session.capacity,
            "sampler": asdict(session.config.sampler),
            "restorable": session.restorable(),
        }

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()


def _diagnostics(diagnostics) -> list[dict]:
    return [to_record(d) for d in diagnostics]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtui-engine")
    parser.add_argument("--records-fd", type=int, required=True)
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--setup", required=True)
    options = parser.parse_args(argv)
    host = EngineHost(RecordPipe(options.records_fd), options.setup)
    # first: an app that dies while the model loads takes the engine with it
    threading.Thread(target=host.read_commands, args=(options.control_fd,), name="kvtui-control", daemon=True).start()
    loaded = host.load()
    host.forget_setup()
    if loaded:
        host.serve()
    # the trace is closed and the app gone or quitting: the interpreter's own teardown (torch's included)
    # can take seconds the app's SIGKILL promise has not got
    host.leave()
    host.pipe.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())

"""The one recorder: it writes the trace of a session or a watched program, whatever drove it (TUI keys, a
headless script, a watched program); the other trace writers are watch/tree.py's merge, which joins the
processes' own records of a command's tree into one file, and a followed server's trace (server/server_trace.py:
events, not steps). It listens to kvtui's own session's events and
owns the recording policy (verify every N steps), so the same script through any front end writes the same
trace, timings aside; a watched program's probe hands it its records (`Recorder.for_records`).

Record kinds (trace schema 1): header, step, diagnostic (raised outside a forward), verify, buffer
(after each turn), rewind, force, sampler, watch, reset, export.
"""

from __future__ import annotations

from pathlib import Path

from .codec import buffer_record, diagnostic_record, verify_record
from .snapshot import SEVERITIES, Diagnostic, StepSnapshot
from .trace import TraceWriter, header_record


class Recorder:
    def __init__(
        self,
        session,
        path: str | Path | None,
        *,
        model_source: str = "",
        model_path: str = "",
        verify_every: int = 0,
        append: bool = False,
        header: dict | None = None,
    ):
        self.session = session
        self.verify_every = verify_every
        self._verified_at = 0  # the step of the last verify
        if header is None and session is not None:
            header = header_record(session, model_source, model_path)
        # header: given whenever session is None (for_records)
        self.writer = TraceWriter(path, header, append=append) if path is not None else None  # type: ignore[arg-type]
        if session is not None:
            session.on_event.add(self.on_event)

    @classmethod
    def for_records(cls, path: str | Path | None, header: dict) -> Recorder:
        """A recorder of records another source builds (a watched program: steps, caches, alarms, verify)."""
        return cls(None, path, header=header)

    def record(self, record: dict | StepSnapshot) -> None:  # a step: serialised once for every sink
        if self.writer is not None:
            self.writer.write(record)

    def on_event(self, kind: str, payload) -> None:
        session = self.session
        if kind == "step":
            self._write(payload)  # the snapshot: serialised once (the pipe to a viewer reuses the line)
            if self.verify_every and payload.step - self._verified_at >= self.verify_every:
                self._verified_at = payload.step
                session.verify()  # emits its own "verify" event
        elif kind == "diagnostics":
            for d in payload:
                self._write(diagnostic_record(d))
        elif kind == "verify":
            self._write(verify_record(payload, session.steps))
        elif kind == "turn-end":
            self._write(buffer_record(session.buffer, session.token_bytes))
        else:  # rewind, force, sampler, watch, reset, export: what happened, at which step
            self._write({"type": kind, "step": session.steps, **payload})

    def _write(self, record: dict | StepSnapshot) -> None:
        if self.writer is not None:
            self.writer.write(record)

    def close(self) -> None:
        if self.session is not None:
            self.session.record_turn_end()  # the last turn, if it ended without its end token
            self.session.on_event.remove(self.on_event)
        if self.writer is not None:
            self.writer.close()


def failing(diagnostics, fail_on: str) -> list[Diagnostic]:
    """The alarms at or above `fail_on` (info, warning, error): the one rule behind --fail-on."""
    threshold = SEVERITIES.index(fail_on)
    return [d for d in diagnostics if SEVERITIES.index(d.severity) >= threshold]

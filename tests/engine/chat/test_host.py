"""The engine process's own source: it owns the handover's files (setup, spool) and a restart goes on with the
same trace; nothing of it is left on disk once it stopped."""

from __future__ import annotations

import json
import os
import pickle
import signal
import tempfile
import time

import pytest

from kvtui.engine.chat.host import EngineSetup, EngineSource
from kvtui.options import AppConfig


def _until(records, *kinds: str) -> dict:
    for record in records:
        if record.get("type") in kinds:
            return record
    raise AssertionError(f"the engine ended before any of {kinds}")


def _steps(path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [r for r in map(json.loads, handle) if r.get("type") == "step"]


def _grown(path, than: int, timeout: float = 30.0) -> list[dict]:
    """The trace's steps once there are more than `than` (the writer thread may lag the pipe's records)."""
    deadline = time.monotonic() + timeout
    while len(steps := _steps(path)) <= than:
        assert time.monotonic() < deadline, f"{path}: still {len(steps)} steps after {timeout} s"
        time.sleep(0.05)
    return steps


def test_a_spooled_engine_restarts_into_the_same_trace_and_leaves_no_file(tiny_dir):
    options = AppConfig(options={"max_new_tokens": 3, "threads": 1}).options
    first = EngineSource(EngineSetup(model=str(tiny_dir("llama")), options=options, trace_path=None))
    spool, first_files = first.trace_path, first.directory
    try:
        assert first.spooled and (first_files / "setup.pickle").exists()
        records = first.records()
        _until(records, "ready")
        first.command("send", {"text": "hi", "run": True})
        assert _until(records, "state")["error"] is None
        assert not first_files.exists()  # the engine removed its setup once loaded
        _grown(spool, 0)  # the turn's steps reach the file from the trace writer's thread
        os.kill(first.pid, signal.SIGKILL)  # it dies (as the out-of-memory killer would): the spool stays
        assert _until(records, "process-exit")["code"] == -signal.SIGKILL
        before = _steps(spool)  # what the dead engine wrote: final

        second = first.restarted()
    except BaseException:
        first.stop()
        raise
    try:
        assert spool.exists()  # the dead engine's spool goes on with the next one
        assert second.spooled and second.trace_path == spool and spool.exists()
        records = second.records()
        _until(records, "ready")
        second.command("send", {"text": "again", "run": True})
        assert _until(records, "state")["error"] is None
        after = _grown(spool, len(before))
        assert after[: len(before)] == before  # appended, not rewritten
    finally:
        second.stop()
    assert not spool.exists() and not second.directory.exists()


def test_a_setup_that_cannot_be_handed_over_leaves_no_file(tmp_path, monkeypatch):
    made = []
    real = tempfile.mkdtemp

    def mkdtemp(*args, **kwargs):
        made.append(real(*args, dir=tmp_path, **{k: v for k, v in kwargs.items() if k != "dir"}))
        return made[-1]

    monkeypatch.setattr("kvtui.engine.chat.host.tempfile.mkdtemp", mkdtemp)
    options = AppConfig().options
    # a clock that pickle refuses (a lambda), and no loaded model to save instead
    with pytest.raises((pickle.PicklingError, AttributeError)):
        EngineSource(EngineSetup(model=None, options=options, trace_path=None, clock=lambda: 0.0))
    assert made and not any(os.path.exists(path) for path in made)

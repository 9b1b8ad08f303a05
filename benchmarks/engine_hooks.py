"""Hooks the benchmarks hand the engine process (pickled by reference as `engine_setup`; the engine
imports this module from the benchmark's import path)."""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path


def _stamp(path: str, session) -> None:
    session.stop_ids = frozenset()  # every turn runs its full --max-new-tokens
    handle = open(path, "a", buffering=1, encoding="utf-8")
    decodes = [0]  # calls of session._reply_text: a full decode of the reply so far (the transcript's cost)
    reply_text = session._reply_text

    def counted():
        decodes[0] += 1
        return reply_text()

    def stamped(snapshot):
        # CLOCK_MONOTONIC: the benchmark process reads the same clock
        handle.write(f"{time.perf_counter()} {snapshot.phase} {snapshot.step} {decodes[0]}\n")

    session._reply_text = counted
    session.on_snapshot.add(stamped, first=True)  # stamped before the engine process sends the step


def stamps(path) -> partial:
    """engine_setup: one line per forward (perf_counter, phase, step) appended to `path`, no stop tokens."""
    return partial(_stamp, str(path))


def reply_decodes(path) -> int:
    """Reply decodes so far, as the last stamp line says."""
    try:
        last = Path(path).read_text(encoding="utf-8").splitlines()[-1].split()
    except (FileNotFoundError, IndexError):
        return 0
    return int(last[3]) if len(last) == 4 else 0


def read_stamps(path) -> list[tuple[float, str, int]]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        parts = line.split()
        if len(parts) == 4:
            out.append((float(parts[0]), parts[1], int(parts[2])))
    return out

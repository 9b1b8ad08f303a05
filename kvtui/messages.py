"""Messages a source's worker thread posts to the app (`post_message` is thread-safe; they arrive in order)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from textual.message import Message

from .engine.records.snapshot import Diagnostic, StepSnapshot, VerifyResult


@dataclass
class SnapshotReady(Message):
    snapshot: StepSnapshot
    messages: list[dict] | None  # None while running between repaints: decoding the reply is O(reply)
    diagnostics: tuple[Diagnostic, ...]
    running: bool
    facts: dict | None = None  # the engine's `session` record just before this step (steps, turn, cache length)
    recorded: bool = False  # its sparkline point and tok/s sample are counted already (own chat, replay)

    def can_replace(self, message: Message) -> bool:
        # In run mode only the newest decode snapshot matters: it carries everything a pane needs.
        # A prefill is kept (the reuse meter reads what it fed), and so is a step that raised an
        # alarm (the diagnostics pane jumps to it).
        # Textual asks the queued (older) message whether the next one may supersede it.
        return isinstance(message, SnapshotReady) and self.snapshot.phase == "decode" and not self.snapshot.diagnostics


@dataclass
class SessionState(Message):
    """Non-step changes: rewinds to empty, resets, verify results, refusals; the engine's `state` record
    after each command (`record`: its facts, None for sources that have none)."""

    messages: list[dict]
    diagnostics: tuple[Diagnostic, ...]
    note: str = ""
    severity: str = "information"
    verify: VerifyResult | None = None
    record: dict | None = None


@dataclass
class Call(Message):
    """Run `callback(*args)` on the UI thread, in order with the other messages: how a source's reader
    thread hands the UI what is not a step (progress, a notice, the program's output, the end)."""

    callback: Callable[..., Any]
    args: tuple = field(default=())

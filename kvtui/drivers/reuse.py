"""The reuse meter, the line under kvtui's chat (its own chat, live or replayed): what this turn took from the
cache, what it fed, what a full re-encode would cost. Only a chat has turns to measure: a chat's drivers own it."""

from __future__ import annotations

from typing import Literal

from ..engine.records.snapshot import StepSnapshot, VerifyResult
from .base import cache_line, ui_cpu


def _load_note(ui_ms: float | None, measured_ms: float) -> str:
    """' (UI busy 120 ms meanwhile)' when the UI thread took a real share of the CPU during a timing."""
    if ui_ms is None or ui_ms < 20 or ui_ms < 0.1 * measured_ms:
        return ""
    return f" (UI busy {ui_ms:.0f} ms meanwhile)"


def _ui_ms_since(before: float | None) -> float | None:
    after = ui_cpu()
    return None if before is None or after is None else (after - before) * 1000


class ReuseMeter:
    """This turn's prefill and the last verify, with the UI thread's CPU while each ran: the two timings are
    only comparable when neither was slowed by the UI (on 2 cores it competes)."""

    def __init__(self) -> None:
        self.prefill: StepSnapshot | None = None  # this turn's prefill
        self.last_verify: VerifyResult | None = None
        self.prefill_ui_ms: float | None = None
        self.verify_ui_ms: float | None = None
        self._before: dict[str, float | None] = {}

    def sent(self, forward: Literal["prefill", "verify"], cpu: float | None) -> None:
        """A prefill or a verify was sent; `cpu`: the UI thread's CPU seconds now (None: not measured)."""
        self._before[forward] = cpu

    def arrived(self, snapshot: StepSnapshot) -> None:
        """A step came back (any thread): a prefill is this turn's."""
        if snapshot.phase == "prefill":
            self.prefill = snapshot
            before = self._before.pop("prefill", None)
            if before is not None:
                self.prefill_ui_ms = _ui_ms_since(before)

    def verified(self, verify: VerifyResult) -> None:
        self.last_verify = verify
        before = self._before.pop("verify", None)
        if before is not None:
            self.verify_ui_ms = _ui_ms_since(before)

    def text(self, snapshot: StepSnapshot) -> str:
        prefill = self.prefill
        if prefill is None or prefill.turn != snapshot.turn:
            return cache_line(snapshot)
        fed = len(prefill.input_ids)
        reused = len(prefill.buffer) - fed
        share = reused / len(prefill.buffer) if len(prefill.buffer) else 0.0
        text = (
            f"turn {snapshot.turn} · reused {reused} cached tokens, fed {fed} ({share:.0%} reuse) · "
            f"prefill {prefill.forward_ms:.0f} ms{_load_note(self.prefill_ui_ms, prefill.forward_ms)}"
        )
        verify = self.last_verify
        if verify is not None:
            text += (
                f" · full re-encode of {verify.tokens} tokens: {verify.ms:.0f} ms"
                f"{_load_note(self.verify_ui_ms, verify.ms)}"
            )
        else:
            text += " · v measures a full re-encode"
        return text

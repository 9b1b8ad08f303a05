"""What the state-like alarms remember between forwards, so each fires once when it starts or changes.

The rules themselves are in the rulebook (diagnostics.py); `Alarms` is the memory they are handed, one
per session or per watched cache, and offers the state-like rules as its methods
(`alarms.check_cursor(step, cursor, cache_len)`).
"""

from __future__ import annotations

from collections.abc import Callable

from ..records.snapshot import Diagnostic
from . import diagnostics


class Alarms:
    """Remembers state-like alarms so each fires once when it starts or changes."""

    def __init__(self):
        self.active: dict[str, str] = {}  # code -> the key of its state now (a gap, "near", "on", ...)

    def transition(self, code: str, key: str | None, make: Callable[[], Diagnostic]) -> list[Diagnostic]:
        if key is None:
            self.active.pop(code, None)
            return []
        if self.active.get(code) == key:
            return []
        self.active[code] = key
        return [make()]

    # The rulebook's state-like rules, called on this memory: alarms.check_layers(step, ...) is
    # diagnostics.check_layers(alarms, step, ...) (the functions themselves, no wrapper in between).
    check_positions = diagnostics.check_positions
    check_cursor = diagnostics.check_cursor
    check_layers = diagnostics.check_layers

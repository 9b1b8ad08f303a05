"""One wait for the server tests: until a condition holds (polled), never a sleep that guards an outcome."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(condition: Callable[[], object], timeout: float = 15.0) -> bool:
    """Whether `condition()` held within `timeout` seconds (asked every 20 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False

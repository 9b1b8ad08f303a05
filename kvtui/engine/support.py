"""The transformers versions kvtui declares and tests: one place, read by `kvtui --version` and at start.

Behaviour that differs between versions is never decided here from the number: introspect tests the
feature (does a passed `cache_position` drive positions, does `QuantizedCache` know the backend, does the
cache class keep a hybrid's state). This module only says whether the installed version is one the suite
runs on (CI: the newest 5.x with the whole suite, 4.57.x with the engine and watch tests).
"""

from __future__ import annotations

# Tested: 4.57.x (the newest 4.x) and 5.23-5.24. 5.0-5.22 are excluded in pyproject.toml: not tested, and
# their cache API moved under them release by release (crop's sign, get_max_length, past recording).
TESTED = (((4, 57), (4, 57)), ((5, 23), (5, 24)))
RANGE_TEXT = "4.57.x and 5.23–5.24"


def _parse(text: str) -> tuple[int, int]:
    major, minor = (text.split(".") + ["0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def installed() -> str:
    """The installed transformers version, read from the package metadata (no import of transformers)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return "not installed"


def is_tested(text: str) -> bool:
    try:
        found = _parse(text)
    except ValueError:
        return False
    return any(low <= found <= high for low, high in TESTED)


def version_line(text: str | None = None) -> str:
    """`transformers 5.24.0 (tested)` or `transformers 5.10.0 (not tested; kvtui is tested on ...)`."""
    text = installed() if text is None else text
    if is_tested(text):
        return f"transformers {text} (tested)"
    return f"transformers {text} (not tested; kvtui is tested on transformers {RANGE_TEXT})"


def warning_line(text: str | None = None) -> str | None:
    """One line to print at start outside the tested range, else None."""
    text = installed() if text is None else text
    if is_tested(text):
        return None
    return (
        f"kvtui: warning: transformers {text} is outside the tested "
        f"range ({RANGE_TEXT}); alarms may describe another version"
    )

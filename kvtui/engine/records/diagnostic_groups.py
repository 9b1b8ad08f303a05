"""Alarms grouped for a viewer: one group per (code, cache), the leading one, and the summary lines the
diagnostics pane, the alarm line and the headless summaries share. Only Diagnostic values: nothing reads a cache here.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from .snapshot import Diagnostic

_CACHE_LABEL = re.compile(r"\b[A-Za-z0-9_]*Cache#\d+\b")
_SEVERITY_RANK = {"error": 0, "warning": 1, "info": 2}


@dataclass(frozen=True)
class DiagnosticGroup:
    """Every alarm of one code on one cache: `ignored-argument ×9, steps 2–38`."""

    code: str
    severity: str  # the most severe of its alarms
    cache: str  # the cache its messages name ('DynamicCache#2'), a server note's publisher, '' when none
    items: tuple[Diagnostic, ...]  # in the order they fired

    @property
    def first(self) -> Diagnostic:
        return self.items[0]

    @property
    def count(self) -> int:
        return len(self.items)

    @property
    def first_step(self) -> int:
        return min(d.step for d in self.items)

    @property
    def last_step(self) -> int:
        return max(d.step for d in self.items)

    @property
    def key(self) -> str:
        return f"{self.code}@{self.cache}" if self.cache else self.code

    def steps_text(self) -> str:
        """'step 12' or 'steps 2–38'."""
        first, last = self.first_step, self.last_step
        return f"step {first}" if first == last else f"steps {first}–{last}"

    def headline(self) -> str:
        """'ignored-argument ×9, steps 2–38' (the count only when it repeats; the cache when one is named)."""
        times = f" ×{self.count}" if self.count > 1 else ""
        on = f" on {self.cache}" if self.cache else ""
        return f"{self.code}{times}{on}, {self.steps_text()}"


def cache_label(message: str) -> str:
    found = _CACHE_LABEL.search(message)
    return found.group(0) if found else ""


def _cache_of(d: Diagnostic) -> str:
    """Which cache an alarm is about: the one its message names, else a server note's publisher."""
    return cache_label(d.message) or (d.where.origin if d.where is not None else "")


def group_diagnostics(diagnostics: Sequence[Diagnostic]) -> list[DiagnosticGroup]:
    """One group per (code, cache), errors first, then warnings, then info; within a severity the
    group that fired first comes first. O(alarms)."""
    groups: dict[tuple[str, str], list[Diagnostic]] = {}
    for d in diagnostics:
        groups.setdefault((d.code, _cache_of(d)), []).append(d)
    built = []
    for (code, cache), items in groups.items():
        severity = min((d.severity for d in items), key=lambda s: _SEVERITY_RANK.get(s, 3))
        built.append(DiagnosticGroup(code, severity, cache, tuple(items)))
    built.sort(key=lambda g: (_SEVERITY_RANK.get(g.severity, 3), g.first_step))
    return built


def leading_group(groups: Sequence[DiagnosticGroup]) -> DiagnosticGroup | None:
    """The alarm that explains the bug first: the first-fired error or warning (ties: the error), else
    the first group (info)."""
    serious = [g for g in groups if g.severity in ("error", "warning")]
    if serious:
        return min(serious, key=lambda g: (g.first_step, _SEVERITY_RANK[g.severity]))
    return groups[0] if groups else None


def group_summary(group: DiagnosticGroup) -> str:
    """One summary line after the severity: 'step   12  pad-in-cache ×3, steps 12–30  <first message>'.
    It starts with the first step, as the per-alarm lines did, so `grep 'error step'` still finds it."""
    return f"step {group.first_step:>4}  {group.headline()}  {group.first.message}"


def group_last(group: DiagnosticGroup) -> str | None:
    """The group's last alarm when it says something else than the first ('last, step 5: static cache
    overflow refused ...'): the summary's second line for that group; None when there is nothing new."""
    last = group.items[-1]
    if group.count == 1 or last.message == group.first.message:
        return None
    return f"last, step {last.step}: {last.message}"


FLOOD_LISTED = 20  # alarms listed per code before the rest are only counted


class FloodGate:
    """One bound on a flood of one code (a busy server's notes): the first FLOOD_LISTED alarms of a code are
    listed, the rest counted (`counts`), and one alarm in each doubling of the count says how many there were
    so far (32, 64, 128 ...). O(1) per alarm; memory O(codes)."""

    def __init__(self, listed: int = FLOOD_LISTED):
        self.listed = listed
        self.counts: dict[str, int] = {}  # every alarm offered, by code (listed or not)

    def would_list(self, count: int) -> bool:
        """Whether the `count`-th alarm of a code is listed (itself or as its doubling's summary), not only counted:
        a producer may skip building the words of one that is not (a flood's cost stays in counting)."""
        return count <= self.listed or count & (count - 1) == 0

    def admit(self, d: Diagnostic) -> Diagnostic | None:
        """The alarm to list (itself, or the doubling's summary of it), or None: counted only."""
        count = self.counts[d.code] = self.counts.get(d.code, 0) + 1
        if count <= self.listed:
            return d
        if self.would_list(count):
            message = (
                f"{count} {d.code} notes so far (only the first {self.listed} and one per doubling are listed); "
                f"the last: {d.message}"
            )
            return Diagnostic(d.code, d.severity, message, d.step, d.where)
        return None

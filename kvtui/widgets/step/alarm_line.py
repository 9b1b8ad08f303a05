"""The alarm line: the alarm that explains the bug first, in one line, where the diagnostics pane is folded.

`render_alarm(groups)` is pure (testable without an App): the leading group
(`engine.records.diagnostic_groups.leading_group`: the first-fired error or warning) with its count and steps
and its first message, then how many other groups there are and the key that unfolds the diagnostics pane.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text

from kvtui.engine.records.diagnostic_groups import DiagnosticGroup, leading_group
from kvtui.fmt import one_line
from kvtui.widgets.shared.live_text import LiveText
from kvtui.widgets.shared.palette import Palette, ThemedPane, role_style

MARKS = {"error": "✗", "warning": "▲", "info": "i"}


def render_alarm(groups: Sequence[DiagnosticGroup], palette: Palette | None = None, key: str = "F6") -> Text:
    """'▲ pad-in-cache, step 12: 4 pad tokens … · +2 more alarms (F6)'; 'no alarms' when there are none."""
    text = Text(no_wrap=True, overflow="ellipsis")
    lead = leading_group(groups)
    if lead is None:
        text.append("no alarms", style=role_style(palette, "muted"))
        return text
    role = {"error": "error", "warning": "warning"}.get(lead.severity, "info")
    text.append(f"{MARKS.get(lead.severity, '?')} {lead.headline()}", style=role_style(palette, role, "bold"))
    others = len(groups) - 1
    if others:
        text.append(f" · +{others} more ({key})", style=role_style(palette, "muted"))
    text.append(": ")
    text.append(one_line(lead.first.message))
    return text


class AlarmLine(ThemedPane, LiveText):
    """One line above the status bar; the app shows it while the diagnostics pane is folded."""

    DEFAULT_CSS = """
    AlarmLine { height: 1; padding: 0 1; background: $panel; }
    """

    def __init__(self, *, name: str | None = None, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(render_alarm(()), name=name, id=id, classes=classes)
        self._groups: Sequence[DiagnosticGroup] = ()

    def on_mount(self) -> None:
        self.follow_theme()
        self.show_groups(self._groups)

    def repaint_theme(self) -> None:
        self.show_groups(self._groups)

    def show_groups(self, groups: Sequence[DiagnosticGroup]) -> None:
        self._groups = groups
        self.show_text(render_alarm(groups, self._palette))

"""The watched program's own stdout and stderr, line by line (never written over the panes)."""

from __future__ import annotations

from textual.widgets import Log

from ..fmt import printable  # a program's ESC[2J must not clear kvtui's screen

MAX_LINES = 5000


class ProgramOutput(Log):
    DEFAULT_CSS = """
    ProgramOutput { height: 1fr; border: round $foreground 25%; border-title-color: $text-muted; }
    """

    def __init__(self, **kwargs):
        super().__init__(max_lines=MAX_LINES, **kwargs)
        self.border_title = "program output"

    def add(self, stream: str, text: str) -> None:
        self.write_line(("stderr│ " if stream == "stderr" else "") + printable(text, newlines=True))

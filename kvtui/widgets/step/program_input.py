"""The watched program's stdin: one line typed here goes to the program (Enter), as in its terminal.

While it has the focus every key typed is the program's: printable keys (q, e, space...) are text, not
kvtui's keys. Enter sends the line, up/down browse the lines sent, ctrl+d ends the program's input (EOF),
ctrl+c interrupts it (SIGINT), esc hands the keys back to the panes. The widget only posts messages; the
app talks to the program.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding
from textual.message import Message
from textual.widgets import Input

PLACEHOLDER = "type a line for the program · Enter sends · ctrl+d ends input · ctrl+c interrupts · esc leaves"
TITLE = "stdin › the program's input (i)"
FOCUSED_TITLE = "stdin › typing to the program · esc gives the keys back"


class ProgramInput(Input):
    DEFAULT_CSS = """
    ProgramInput { border: round $foreground 25%; border-title-color: $text-muted; }
    ProgramInput:focus { border: round $accent; border-title-color: $accent; border-title-style: bold; }
    """

    BINDINGS = [
        Binding("up", "history(-1)", "previous line", show=False),
        Binding("down", "history(1)", "next line", show=False),
        Binding("ctrl+d", "end_input", "end input (EOF)"),
        Binding("ctrl+c", "interrupt", "interrupt (SIGINT)"),
        Binding("escape", "leave", "back to the panes"),
    ]

    @dataclass
    class Line(Message):
        """Enter: this line (without its newline) goes to the program's stdin."""

        text: str

    class EndInput(Message):
        """ctrl+d: close the program's stdin."""

    class Interrupt(Message):
        """ctrl+c: SIGINT to the program."""

    class Leave(Message):
        """esc: the keys go back to the panes."""

    def __init__(self, **kwargs):
        super().__init__(placeholder=PLACEHOLDER, **kwargs)
        self.border_title = TITLE
        self.history: list[str] = []  # the lines sent, oldest first
        self._browse: int | None = None  # index into history while browsing with up/down
        self._draft = ""  # what was typed before browsing began

    def on_focus(self) -> None:
        self.border_title = FOCUSED_TITLE

    def on_blur(self) -> None:
        self.border_title = TITLE

    async def action_submit(self) -> None:
        text = self.value
        if text and (not self.history or self.history[-1] != text):
            self.history.append(text)
        self._browse, self._draft = None, ""
        self.value = ""
        self.post_message(self.Line(text))

    def action_history(self, direction: int) -> None:
        if not self.history:
            return
        if self._browse is None:
            if direction > 0:
                return
            self._draft, self._browse = self.value, len(self.history)
        self._browse = max(0, self._browse + direction)
        if self._browse >= len(self.history):
            self._browse, self.value = None, self._draft
        else:
            self.value = self.history[self._browse]
        self.cursor_position = len(self.value)

    def action_end_input(self) -> None:
        self.post_message(self.EndInput())

    def action_interrupt(self) -> None:
        self.post_message(self.Interrupt())

    def action_leave(self) -> None:
        self.post_message(self.Leave())

    def close(self, why: str) -> None:
        """The program's input is over (it ended, or ctrl+d closed it): no more typing here."""
        self.value = ""
        self.placeholder = why
        self.border_title = "stdin › closed"
        self.disabled = True

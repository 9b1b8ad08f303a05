"""The watched program's own stdout and stderr, line by line (never written over the panes).

An unterminated line (a prompt such as input("you> "), a progress bar) shows as the current last line of
its stream and is replaced as it grows or completes. A line the person sent to the program's stdin is
echoed as a terminal echoes it: after a pending prompt on the same line (else after "› "), in the echo style.
"""

from __future__ import annotations

from rich.cells import cell_len
from rich.segment import Segment
from textual.strip import Strip
from textual.widgets import Log

from ...fmt import printable  # a program's ESC[2J must not clear kvtui's screen

MAX_LINES = 5000
ECHO_MARK = "› "  # before an echoed line when no prompt was pending


class ProgramOutput(Log):
    COMPONENT_CLASSES = {"program-output--echo"}
    DEFAULT_CSS = """
    ProgramOutput { height: 1fr; border: round $foreground 25%; border-title-color: $text-muted; }
    ProgramOutput > .program-output--echo { color: $accent; text-style: bold; }
    """

    def __init__(self, **kwargs):
        super().__init__(max_lines=MAX_LINES, **kwargs)
        self.border_title = "program output"
        self._pruned = 0  # lines dropped from the top (max_lines): absolute line = index + _pruned
        self._partial: dict[str, int] = {}  # stream -> absolute line of its pending partial line
        self._echo: dict[int, int] = {}  # absolute line -> column where the echoed text starts

    @property
    def partial(self) -> dict[str, str]:
        """The pending (unterminated) line of each stream, as shown."""
        return {
            stream: self._lines[line - self._pruned]
            for stream, line in self._partial.items()
            if 0 <= line - self._pruned < len(self._lines)
        }

    def add(self, stream: str, text: str, partial: bool = False) -> None:
        """One record of the program's output; `partial`: the unterminated line so far (replaced later).
        Stream "stdin": a line the person sent, echoed."""
        if stream == "stdin":
            self.echo(text)
            return
        line = ("stderr│ " if stream == "stderr" else "") + _clean(text)
        pending = self._partial.pop(stream, None)
        if pending is not None and self._replace(pending, line):
            if partial:
                self._partial[stream] = pending
            return
        self._append(line)
        if partial:
            self._partial[stream] = self._absolute_last()

    def echo(self, text: str) -> None:
        """A sent line: it completes the pending stdout prompt (or stands on a line of its own after a mark)."""
        text = _clean(text)
        prompt = self._partial.pop("stdout", None)
        if prompt is not None:
            shown = self._lines[prompt - self._pruned] if 0 <= prompt - self._pruned < len(self._lines) else None
            if shown is not None and self._replace(prompt, shown + text):
                self._echo[prompt] = cell_len(shown.expandtabs())
                return
        self._append(ECHO_MARK + text)
        self._echo[self._absolute_last()] = 0

    # ---- lines ---------------------------------------------------------------------------------------

    def _append(self, line: str) -> None:
        before = len(self._lines)
        self.write_line(line)
        dropped = before + 1 - len(self._lines)
        if dropped > 0:
            self._pruned += dropped
            self._echo = {number: column for number, column in self._echo.items() if number >= self._pruned}

    def _absolute_last(self) -> int:
        return self._pruned + len(self._lines) - 1

    def _replace(self, absolute: int, line: str) -> bool:
        index = absolute - self._pruned
        if not 0 <= index < len(self._lines):
            return False  # scrolled out of max_lines
        self._lines[index] = line
        self._echo.pop(absolute, None)
        self._width = max(self._width, cell_len(line.expandtabs()))
        self.virtual_size = self.virtual_size.with_width(self._width)
        self.refresh_lines(index)
        if self.auto_scroll:
            self.scroll_end(animate=False, immediate=False, x_axis=False)
        return True

    def render_line(self, y: int) -> Strip:
        strip = super().render_line(y)
        scroll_x, scroll_y = self.scroll_offset
        column = self._echo.get(scroll_y + y + self._pruned)
        if column is None:
            return strip
        cut = max(0, column - scroll_x)
        style = self.get_component_rich_style("program-output--echo", partial=True)
        echoed = [
            Segment(text, (seg_style + style) if seg_style else style, control)
            for text, seg_style, control in strip.crop(cut, strip.cell_length)
        ]
        return Strip.join([strip.crop(0, cut), Strip(echoed)])


def _clean(text: str) -> str:
    """One line as shown: control characters escaped (tabs kept), never a line break."""
    return printable(text, newlines=True).replace("\n", "⏎")

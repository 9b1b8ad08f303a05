"""The watched program's own stdout and stderr, line by line (never written over the panes), wrapped to the
pane's width: a reply is text to read, so it is never cut.

Complete lines go to a RichLog (wrapped as written, wrapped again when the pane's width changes). An
unterminated line (a prompt such as input("you> "), a progress bar) shows under them as its stream's pending
line and is replaced as it grows or completes. A line the person sent to the program's stdin is echoed as a
terminal echoes it: after a pending prompt on the same line (else after "› "), in the echo style.
"""

from __future__ import annotations

from collections import deque

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import RichLog, Static

from ...fmt import printable  # a program's ESC[2J must not clear kvtui's screen

MAX_LINES = 5000
ECHO_MARK = "› "  # before an echoed line when no prompt was pending
STDERR_MARK = "stderr│ "


class WrappedLog(RichLog):
    """A RichLog that wraps its lines again when its width changes (RichLog wraps each line once, as written)."""

    def __init__(self, **kwargs):
        super().__init__(wrap=True, markup=False, highlight=False, min_width=1, max_lines=MAX_LINES, **kwargs)
        self._wrapped_at = 0  # the width the lines were wrapped to

    def on_resize(self) -> None:
        width = self.scrollable_content_region.width
        if self._size_known and width and width != self._wrapped_at:
            self._wrapped_at = width
            self.parent.rewrap()  # type: ignore[union-attr]  (ProgramOutput)


class ProgramOutput(Vertical):
    COMPONENT_CLASSES = {"program-output--echo"}
    DEFAULT_CSS = """
    ProgramOutput { height: 1fr; border: round $foreground 25%; border-title-color: $text-muted; }
    ProgramOutput > .program-output--echo { color: $accent; text-style: bold; }
    ProgramOutput > WrappedLog {
        height: 1fr; background: transparent; overflow-x: hidden; overflow-y: auto; scrollbar-size-vertical: 1;
    }
    ProgramOutput > #pending { height: auto; max-height: 50%; }
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.border_title = "program output"
        self._lines: deque[tuple[str, int | None]] = deque(maxlen=MAX_LINES)  # (line, where the echo starts)
        self._partial: dict[str, str] = {}  # stream -> its pending (unterminated) line, as shown

    def compose(self) -> ComposeResult:
        yield WrappedLog(id="output-log")
        yield Static("", id="pending", markup=False)

    @property
    def lines(self) -> list[str]:
        """The complete lines, as shown (oldest first, at most MAX_LINES)."""
        return [line for line, _ in self._lines]

    @property
    def partial(self) -> dict[str, str]:
        """The pending (unterminated) line of each stream, as shown."""
        return dict(self._partial)

    def add(self, stream: str, text: str, partial: bool = False) -> None:
        """One record of the program's output; `partial`: the unterminated line so far (replaced later).
        Stream "stdin": a line the person sent, echoed."""
        if stream == "stdin":
            self.echo(text)
            return
        line = (STDERR_MARK if stream == "stderr" else "") + _clean(text)
        self._partial.pop(stream, None)  # a record replaces the stream's pending line
        if partial:
            self._partial[stream] = line
            self._show_pending()
            return
        self._show_pending()
        self._append(line, None)

    def echo(self, text: str) -> None:
        """A sent line: it completes the pending stdout prompt (or stands on a line of its own after a mark)."""
        text = _clean(text)
        prompt = self._partial.pop("stdout", None)
        self._show_pending()
        if prompt is not None:
            self._append(prompt + text, len(prompt))
        else:
            self._append(ECHO_MARK + text, 0)

    def rewrap(self) -> None:
        """Every kept line written again at the log's width (O(lines), on a width change only)."""
        log = self.query_one(WrappedLog)
        log.clear()
        for line, echo in self._lines:
            log.write(self._styled(line, echo))

    # ---- lines ---------------------------------------------------------------------------------------

    def _append(self, line: str, echo: int | None) -> None:
        self._lines.append((line, echo))
        self.query_one(WrappedLog).write(self._styled(line, echo))

    def _styled(self, line: str, echo: int | None) -> Text:
        text = Text(line)
        if echo is not None:
            text.stylize(self.get_component_rich_style("program-output--echo", partial=True), echo)
        return text

    def _show_pending(self) -> None:
        pending = self.query_one("#pending", Static)
        shown = [self._partial[stream] for stream in ("stdout", "stderr") if stream in self._partial]
        pending.update(Text("\n".join(shown)))
        pending.display = bool(shown)


def _clean(text: str) -> str:
    """One line as shown: control characters escaped (tabs kept), never a line break."""
    return printable(text, newlines=True).replace("\n", "⏎")

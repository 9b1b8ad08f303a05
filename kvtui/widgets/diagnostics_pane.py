"""The diagnostics pane: every alarm of the session in a DataTable, newest at the bottom.

`diagnostic_cells(d)`, `severity_counts(...)` and `title_for(...)` are pure (testable without an
App). The session's diagnostics list only grows, so `show_diagnostics` appends the new rows when the
sequence it is given extends what is shown (checked in O(1) on its ends, not element by element)
and rebuilds only when it does not (after a reset). Long messages are truncated in the cell; the full
text is in the detail line under the table and in the table's tooltip for the highlighted row.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import DataTable, Static

from kvtui.fmt import one_line, printable
from kvtui.engine.snapshot import SEVERITIES, Diagnostic, StepSnapshot
from kvtui.widgets.palette import DEFAULT_PALETTE, Palette, role_style, theme_palette

COLUMNS: tuple[tuple[str, str], ...] = (
    ("step", "step"),
    ("severity", "severity"),
    ("code", "code"),
    ("message", "message"),
)
MESSAGE_WIDTH = 72
_SEVERITY_ROLES = {"info": "info", "warning": "warning", "error": "error"}


def truncate(message: str, width: int = MESSAGE_WIDTH) -> str:
    flat = one_line(message)  # one line in the cell, control characters escaped
    return flat if len(flat) <= width else flat[: max(width - 1, 0)] + "…"


def severity_style(severity: str, palette: Palette | None = None) -> str:
    role = _SEVERITY_ROLES.get(severity, "muted")
    return role_style(palette, role, "bold" if severity == "error" else "")


def diagnostic_cells(
    diagnostic: Diagnostic, palette: Palette | None = None, width: int = MESSAGE_WIDTH
) -> tuple[Text, ...]:
    """The cells of one row, in COLUMNS order (Text, never markup)."""
    style = severity_style(diagnostic.severity, palette)
    return (
        Text(str(diagnostic.step), justify="right"),
        Text(diagnostic.severity, style=style),
        Text(diagnostic.code, style=style),
        Text(truncate(diagnostic.message, width)),
    )


def severity_counts(diagnostics: Iterable[Diagnostic]) -> dict[str, int]:
    counts = {severity: 0 for severity in SEVERITIES}
    for d in diagnostics:
        counts[d.severity] = counts.get(d.severity, 0) + 1
    return counts


def title_for(counts: dict[str, int]) -> str:
    """'diagnostics · 2 errors · 1 warning · 3 info' (zero counts left out)."""
    parts = ["diagnostics"]
    for severity in ("error", "warning", "info"):
        n = counts.get(severity, 0)
        if n:
            parts.append(f"{n} {severity}" + ("s" if n != 1 and severity != "info" else ""))
    for severity, n in counts.items():  # an unknown severity still gets counted
        if severity not in SEVERITIES and n:
            parts.append(f"{n} {severity}")
    return " · ".join(parts)


def render_detail(diagnostic: Diagnostic | None, palette: Palette | None = None) -> Text:
    """The full, untruncated diagnostic for the line under the table."""
    text = Text()
    if diagnostic is None:
        text.append("no diagnostics", style=role_style(palette, "muted"))
        return text
    text.append(f"step {diagnostic.step} ", style=role_style(palette, "muted"))
    text.append(f"{diagnostic.severity} {diagnostic.code}", style=severity_style(diagnostic.severity, palette))
    text.append(": ")
    text.append(printable(diagnostic.message, newlines=True))
    return text


class DiagnosticsPane(Vertical):
    """All alarms (step, severity, code, message); enter posts JumpTo."""

    DEFAULT_CSS = """
    DiagnosticsPane {
        height: 1fr;
        border: round $primary;
        border-title-color: $primary;
    }
    DiagnosticsPane.-warnings {
        border: round $warning;
        border-title-color: $warning;
    }
    DiagnosticsPane.-errors {
        border: round $error;
        border-title-color: $error;
    }
    DiagnosticsPane > DataTable {
        height: 1fr;
    }
    DiagnosticsPane > #diagnostics-detail {
        height: auto;
        max-height: 4;
        padding: 0 1;
        color: $text-muted;
    }
    """

    class JumpTo(Message):
        """The user selected a diagnostic: go to the step that raised it."""

        def __init__(self, step: int, diagnostic: Diagnostic) -> None:
            super().__init__()
            self.step = step
            self.diagnostic = diagnostic

    def __init__(
        self,
        *,
        message_width: int = MESSAGE_WIDTH,
        name: str | None = None,
        id: str | None = None,
        classes: str | None = None,
    ) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.message_width = message_width
        self.border_title = "diagnostics"
        self._shown: list[Diagnostic] = []
        self._pending: Sequence[Diagnostic] | None = None  # given before mount
        self._counts = severity_counts(())
        self._palette: dict[str, str] = dict(DEFAULT_PALETTE)
        self._ready = False

    def compose(self) -> ComposeResult:
        table: DataTable = DataTable(id="diagnostics-table", cursor_type="row")
        for key, label in COLUMNS:
            table.add_column(label, key=key)
        yield table
        yield Static(render_detail(None), id="diagnostics-detail")

    def on_mount(self) -> None:
        self._ready = True  # is_mounted only turns True after on_mount returns
        self._palette = theme_palette(self.app)
        self.app.theme_changed_signal.subscribe(self, self._theme_changed)
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.show_diagnostics(pending)

    def _theme_changed(self, _theme) -> None:
        self._palette = theme_palette(self.app)
        shown, self._shown = self._shown, []
        self._rebuild(shown)

    # -- public API -----------------------------------------------------------------------------

    @property
    def table(self) -> DataTable:
        return self.query_one("#diagnostics-table", DataTable)

    @property
    def diagnostics(self) -> Sequence[Diagnostic]:
        """What is shown (do not mutate)."""
        return self._shown

    @property
    def counts(self) -> dict[str, int]:
        return dict(self._counts)

    @property
    def selected_diagnostic(self) -> Diagnostic | None:
        if not self._ready:
            return None
        row = self.table.cursor_row
        return self._shown[row] if 0 <= row < len(self._shown) else None

    def show(self, snapshot: StepSnapshot | None) -> None:
        """Snapshots carry only their own step's diagnostics: feed the full list to show_diagnostics."""

    def show_diagnostics(self, diagnostics: Sequence[Diagnostic]) -> None:
        if not self._ready:
            self._pending = diagnostics
            return
        shown = self._shown
        n = len(shown)
        extends = len(diagnostics) >= n and (n == 0 or (diagnostics[n - 1] == shown[-1] and diagnostics[0] == shown[0]))
        if extends:
            if len(diagnostics) > n:
                self._append(diagnostics[n:])
        else:
            self._rebuild(diagnostics)

    # -- internals ------------------------------------------------------------------------------

    def _append(self, new: Sequence[Diagnostic]) -> None:
        table = self.table
        follow = table.row_count == 0 or table.cursor_row >= table.row_count - 1
        start = len(self._shown)
        for offset, diagnostic in enumerate(new):
            table.add_row(*diagnostic_cells(diagnostic, self._palette, self.message_width), key=f"diag-{start + offset}")
            self._counts[diagnostic.severity] = self._counts.get(diagnostic.severity, 0) + 1
        self._shown.extend(new)
        if follow and table.row_count:
            table.move_cursor(row=table.row_count - 1)
        self._update_title()
        self._update_detail()

    def _rebuild(self, diagnostics: Sequence[Diagnostic]) -> None:
        table = self.table
        cursor = table.cursor_row
        table.clear()
        self._shown = []
        self._counts = severity_counts(())
        if diagnostics:
            self._append(diagnostics)
            table.move_cursor(row=min(max(cursor, 0), table.row_count - 1))
        self._update_title()
        self._update_detail()

    def _update_title(self) -> None:
        self.border_title = title_for(self._counts)
        self.set_class(self._counts.get("error", 0) > 0, "-errors")
        self.set_class(self._counts.get("error", 0) == 0 and self._counts.get("warning", 0) > 0, "-warnings")

    def _update_detail(self) -> None:
        diagnostic = self.selected_diagnostic
        self.query_one("#diagnostics-detail", Static).update(render_detail(diagnostic, self._palette))
        self.table.tooltip = None if diagnostic is None else printable(diagnostic.message, newlines=True)

    @on(DataTable.RowHighlighted, "#diagnostics-table")
    def _row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()
        self._update_detail()

    @on(DataTable.RowSelected, "#diagnostics-table")
    def _row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        if 0 <= event.cursor_row < len(self._shown):
            diagnostic = self._shown[event.cursor_row]
            self.post_message(self.JumpTo(diagnostic.step, diagnostic))

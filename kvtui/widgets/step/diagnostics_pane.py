"""The diagnostics pane: the session's alarms grouped by code and cache, the cause first.

One row per group (`engine.records.diagnostic_groups.group_diagnostics`, which the headless summaries
share): its code and count, its first and last step, severity and first message; errors first, then warnings, then info.
Unless the person moved the cursor, the row selected is the first-fired error or warning
(`leading_group`), shown in full in the detail line under the table. `x` expands a group into one row per
alarm (and folds it again); Enter on a group jumps to its first step, on an alarm to its step.

`diagnostic_cells(d)`, `group_cells(g)`, `severity_counts(...)` and `title_for(...)` are pure (testable
without an App). Rows are keyed and updated in place (`table_rows.update_rows`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import DataTable, Static

from kvtui.engine.records.diagnostic_groups import DiagnosticGroup, group_diagnostics, leading_group
from kvtui.engine.records.snapshot import SEVERITIES, Diagnostic, StepSnapshot
from kvtui.fmt import one_line, printable
from kvtui.widgets.shared.palette import Palette, ThemedPane, role_style
from kvtui.widgets.shared.table_rows import update_rows

COLUMNS: tuple[tuple[str, str], ...] = (
    ("step", "step"),
    ("severity", "severity"),
    ("code", "code"),
    ("message", "message"),
)
# the grouped table: what a narrow pane cuts last (the code and count) first
GROUP_COLUMNS: tuple[tuple[str, str], ...] = (
    ("code", "alarm"),
    ("steps", "steps"),
    ("severity", "severity"),
    ("message", "first message"),
)
EXPANDED_MARK, FOLDED_MARK = "▾", "▸"
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


def group_cells(
    group: DiagnosticGroup, palette: Palette | None = None, width: int = MESSAGE_WIDTH, expanded: bool = False
) -> tuple[Text, ...]:
    """A group's row, in GROUP_COLUMNS order: '▸ ignored-argument ×9', '2–38', 'warning', its first message."""
    style = severity_style(group.severity, palette)
    mark = (EXPANDED_MARK if expanded else FOLDED_MARK) if group.count > 1 else " "
    times = f" ×{group.count}" if group.count > 1 else ""
    on = f" {group.cache}" if group.cache else ""
    first, last = group.first_step, group.last_step
    return (
        Text(f"{mark} {group.code}{times}{on}", style=style),
        Text(str(first) if first == last else f"{first}–{last}", justify="right"),
        Text(group.severity, style=style),
        Text(truncate(group.first.message, width)),
    )


def item_cells(diagnostic: Diagnostic, palette: Palette | None = None, width: int = MESSAGE_WIDTH) -> tuple[Text, ...]:
    """One alarm of an expanded group, in GROUP_COLUMNS order."""
    return (
        Text(f"   {diagnostic.code}", style=role_style(palette, "muted")),
        Text(str(diagnostic.step), justify="right"),
        Text(diagnostic.severity, style=severity_style(diagnostic.severity, palette)),
        Text(truncate(diagnostic.message, width)),
    )


def render_group_detail(
    group: DiagnosticGroup | None, diagnostic: Diagnostic | None = None, palette: Palette | None = None
) -> Text:
    """The detail line: the group's headline, then its first (or the selected) alarm in full."""
    if group is None:
        return render_detail(None, palette)
    if group.count == 1:  # the headline would only repeat the alarm's own step and code
        return render_detail(diagnostic or group.first, palette)
    text = Text()
    text.append(group.headline(), style=severity_style(group.severity, palette))
    text.append(" · ", style=role_style(palette, "muted"))
    text.append_text(render_detail(diagnostic or group.first, palette))
    return text


class DiagRow(NamedTuple):
    key: str
    group: DiagnosticGroup
    diagnostic: Diagnostic  # the group's first alarm for a group row
    cells: tuple[Text, ...]


def diagnostic_rows(
    groups: Sequence[DiagnosticGroup], expanded: set[str], palette: Palette | None = None, width: int = MESSAGE_WIDTH
) -> list[DiagRow]:
    rows = []
    for group in groups:
        is_open = group.key in expanded and group.count > 1
        rows.append(DiagRow(f"group-{group.key}", group, group.first, group_cells(group, palette, width, is_open)))
        if is_open:
            for i, d in enumerate(group.items):
                rows.append(DiagRow(f"item-{group.key}-{i}", group, d, item_cells(d, palette, width)))
    return rows


class DiagnosticsPane(ThemedPane, Vertical):
    """The alarms grouped by code and cache, the cause first; enter posts JumpTo, x expands a group."""

    BINDINGS = [Binding("x", "toggle_group", "expand/fold alarm group")]

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
        self._shown: tuple[Diagnostic, ...] = ()
        self._groups: list[DiagnosticGroup] = []
        self._rows: list[DiagRow] = []
        self._expanded: set[str] = set()
        self._chosen: str | None = None  # the row key the person moved to; None: follow the leading alarm
        self._auto: str | None = None  # the row key the pane itself put the cursor on
        self._pending: Sequence[Diagnostic] | None = None  # given before mount
        self._counts = severity_counts(())
        self._ready = False

    def compose(self) -> ComposeResult:
        table: DataTable = DataTable(id="diagnostics-table", cursor_type="row")
        for key, label in GROUP_COLUMNS:
            table.add_column(label, key=key)
        yield table
        yield Static(render_detail(None), id="diagnostics-detail")

    def on_mount(self) -> None:
        self._ready = True  # is_mounted only turns True after on_mount returns
        self.follow_theme()
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.show_diagnostics(pending)

    def repaint_theme(self) -> None:
        self._refresh(force=True)

    # -- public API -----------------------------------------------------------------------------

    @property
    def table(self) -> DataTable:
        return self.query_one("#diagnostics-table", DataTable)

    @property
    def diagnostics(self) -> Sequence[Diagnostic]:
        """Every alarm given (do not mutate)."""
        return self._shown

    @property
    def groups(self) -> list[DiagnosticGroup]:
        return list(self._groups)

    @property
    def counts(self) -> dict[str, int]:
        return dict(self._counts)

    @property
    def selected_row(self) -> DiagRow | None:
        if not self._ready:
            return None
        row = self.table.cursor_row
        return self._rows[row] if 0 <= row < len(self._rows) else None

    @property
    def selected_group(self) -> DiagnosticGroup | None:
        row = self.selected_row
        return None if row is None else row.group

    @property
    def selected_diagnostic(self) -> Diagnostic | None:
        row = self.selected_row
        return None if row is None else row.diagnostic

    def show(self, snapshot: StepSnapshot | None) -> None:
        """Snapshots carry only their own step's diagnostics: feed the full list to show_diagnostics."""

    def show_diagnostics(self, diagnostics: Sequence[Diagnostic]) -> None:
        if not self._ready:
            self._pending = diagnostics
            return
        diagnostics = tuple(diagnostics)
        if diagnostics == self._shown:
            return
        if len(diagnostics) < len(self._shown):  # a reset: nothing the person chose is left
            self._chosen = None
            self._expanded.clear()
        self._shown = diagnostics
        self._refresh()

    def action_toggle_group(self) -> None:
        row = self.selected_row
        if row is None or row.group.count < 2:
            return
        key = row.group.key
        self._expanded.symmetric_difference_update({key})
        self._chosen = f"group-{key}"
        self._refresh()

    # -- internals ------------------------------------------------------------------------------

    def _refresh(self, force: bool = False) -> None:
        self._groups = group_diagnostics(self._shown)
        self._counts = severity_counts(self._shown)
        rows = diagnostic_rows(self._groups, self._expanded, self._palette, self.message_width)
        table = self.table
        keys = [row.key for row in rows]
        target = self._chosen if self._chosen in keys else None
        if target is None:
            self._chosen = None
            leading = leading_group(self._groups)
            target = None if leading is None else f"group-{leading.key}"
        update_rows(table, self._rows, rows, [key for key, _ in GROUP_COLUMNS], force=force)
        self._rows = rows
        if target is not None:
            self._auto = target  # its RowHighlighted arrives later: not a choice of the person's
            table.move_cursor(row=keys.index(target))
        self._update_title()
        self._update_detail()

    def _update_title(self) -> None:
        self.border_title = title_for(self._counts)
        self.set_class(self._counts.get("error", 0) > 0, "-errors")
        self.set_class(self._counts.get("error", 0) == 0 and self._counts.get("warning", 0) > 0, "-warnings")

    def _update_detail(self) -> None:
        row = self.selected_row
        group, diagnostic = (None, None) if row is None else (row.group, row.diagnostic)
        self.query_one("#diagnostics-detail", Static).update(render_group_detail(group, diagnostic, self._palette))
        self.table.tooltip = None if diagnostic is None else printable(diagnostic.message, newlines=True)

    @on(DataTable.RowHighlighted, "#diagnostics-table")
    def _row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()
        if 0 <= event.cursor_row < len(self._rows):
            key = self._rows[event.cursor_row].key
            if key != self._auto and self.table.has_focus:
                self._chosen = key
        self._update_detail()

    @on(DataTable.RowSelected, "#diagnostics-table")
    def _row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        if 0 <= event.cursor_row < len(self._rows):
            row = self._rows[event.cursor_row]
            self._chosen = row.key
            self.post_message(self.JumpTo(row.diagnostic.step, row.diagnostic))

"""Keyed DataTable rows updated in place: how the layers and top-k panes show a new step.

A row is anything with a `key` and its `cells` (Rich Text, in column order). When the new rows have the
same keys in the same order, only the cells that changed are written and the cursor stays where it is;
otherwise the table is rebuilt and the cursor kept on its row index.

Column widths: a cell written with `update_width` makes the DataTable re-measure its column, and a width
that changes changes the table's virtual size, which costs a screen-wide layout pass. While the model
decodes (a new step every few tens of ms, every token piece of a different length) `widen_only` re-measures
a column only when a value no longer fits it, so columns settle after a few steps instead of jittering at
every one, and the repaints cost no layout; any other step (a prefill, a rewind) or a rebuilt table lets
columns narrow again. The top-k pane does not use it: its columns follow the shown step alone, so a step
looks the same whatever the path to it (replay played through vs opened caught up).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from rich.text import Text
from textual.widgets import DataTable
from textual.widgets.data_table import ColumnKey


class Row(Protocol):
    @property
    def key(self) -> str: ...

    @property
    def cells(self) -> tuple[Text, ...]: ...


def update_rows(
    table: DataTable,
    old: Sequence[Row],
    new: Sequence[Row],
    columns: Sequence[str],
    *,
    force: bool = False,
    widen_only: bool = False,
    cursor: int | None = None,
) -> None:
    """Show `new` in `table`, which shows `old`; `force` rewrites every cell (a new theme's styles).
    `cursor`: the row to keep the cursor on when the table is rebuilt (default: where it is)."""
    if len(old) == len(new) and all(a.key == b.key for a, b in zip(old, new)):
        for before_row, row in zip(old, new):
            if not force and before_row.cells == row.cells:
                continue
            for column, before, after in zip(columns, before_row.cells, row.cells):
                if force or before != after:
                    if widen_only:
                        measure = after.cell_len > table.columns[ColumnKey(column)].content_width
                    else:  # a narrower value re-measures the column too; an equal width needs nothing
                        measure = after.cell_len != before.cell_len
                    table.update_cell(row.key, column, after, update_width=measure)
        return
    if cursor is None:
        cursor = table.cursor_row
    table.clear()
    # clear() keeps the old widths: each column is as wide as its label and the new rows' cells alone (set here:
    # add_row only widens a column, from whatever width it had)
    for index, key in enumerate(columns):
        column = table.columns[ColumnKey(key)]
        column.content_width = max([column.label.cell_len, *(row.cells[index].cell_len for row in new)])
    for row in new:
        table.add_row(*row.cells, key=row.key)
    if new:
        table.move_cursor(row=min(max(cursor, 0), len(new) - 1), scroll=False)


def fit_columns(
    labels: Sequence[str], rows: Sequence[Sequence[Text]], priority: Sequence[int], width: int
) -> list[int]:
    """The column indices to show in `width` cells: every column when all fit, else the columns of `priority`
    (most important first) that fit, in their table order. A DataTable column takes its widest cell (or label)
    plus one cell of padding on each side. O(rows × columns)."""
    need = [max([len(label), *(row[i].cell_len for row in rows)]) + 2 for i, label in enumerate(labels)]
    if sum(need) <= width:
        return list(range(len(labels)))
    chosen: list[int] = []
    used = 0
    for i in priority:
        if used + need[i] <= width or not chosen:
            chosen.append(i)
            used += need[i]
    return sorted(chosen)

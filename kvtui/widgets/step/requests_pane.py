"""The requests pane: the lanes of a continuous-batching forward, one DataTable row per request.

`request_cells(request)`, `request_rows(requests)`, `kept_requests(...)` and `for_request(...)` are pure
(testable without an App); `RequestsPane` updates the table in place (`table_rows.update_rows`) and keeps its
cursor on the selected request while others arrive and finish, posting `RequestSelected` when it moves.
Shown only for a packed forward (`StepSnapshot.requests` set: a watched `generate_batch` or a server).
O(requests) per step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import NamedTuple

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import DataTable

from kvtui.engine.records.snapshot import RequestView, StepSnapshot, TokenBuffer
from kvtui.widgets.shared.palette import Palette, ThemedPane, role_style
from kvtui.widgets.shared.table_rows import fit_columns, update_rows

COLUMNS: tuple[tuple[str, str], ...] = (
    ("id", "request"),
    ("status", "status"),
    ("phase", "phase"),
    ("fed", "fed/held"),
    ("tokens", "prompt+gen"),
    ("hit", "hit"),
    ("recomputed", "recomp"),
    ("blocks", "blocks"),
    ("shared", "shared"),
)
# what a narrow pane keeps, most important first (the waste, hit and recomputed, and the blocks each request
# holds, before the phase, which the status mostly says); at 80x24 request, status, fed/held, hit, recomputed
# and blocks fit
PRIORITY = (0, 1, 3, 6, 5, 7, 2, 4, 8)
STATUS_ROLES = {
    "waiting": "muted",
    "prefilling": "primary",
    "decoding": "success",
    "finished": "accent",
    "failed": "error",
    "left": "muted",  # no longer scheduled, last seen unfinished: how it ended was not seen (no forward since)
}
BLOCKS_WIDTH = 32  # a block table longer than this ends in …
ID_WIDTH = 10  # a longer request id (a server's 36-character uuid) shows its head and tail; selected, it shows whole
KEPT_DEPARTED = 32  # requests no longer live that the list still shows (newest first), finished or not


def format_table(table: tuple[int, ...]) -> str:
    """A block table with runs folded: (0, 1, 2, 5, 7, 8) -> '0-2,5,7-8'. O(blocks)."""
    parts: list[str] = []
    start = previous = None
    for block in table:
        if previous is not None and block == previous + 1:
            previous = block
            continue
        if start is not None:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = block
    if start is not None:
        parts.append(str(start) if start == previous else f"{start}-{previous}")
    return ",".join(parts)


def format_blocks(blocks: tuple[tuple[str, tuple[int, ...]], ...], width: int = BLOCKS_WIDTH) -> str:
    """'full 4 [0-3]' per group (one group: its name left out): block count and table, cut to `width`."""
    if not blocks:
        return "-"
    shown = [
        (f"{group} " if len(blocks) > 1 else "") + f"{len(table)} [{format_table(table)}]" for group, table in blocks
    ]
    text = " · ".join(shown)
    return text if len(text) <= width else text[: width - 1] + "…"


def short_id(request_id: str, width: int = ID_WIDTH) -> str:
    """'chatcmpl-3b9f…02c9a1' for a long id: its head (the kind of request) and tail (what differs between
    requests); the cursor pane names the selected request in full."""
    if len(request_id) <= width:
        return request_id
    tail = (width - 1) // 2
    return f"{request_id[: width - 1 - tail]}…{request_id[-tail:]}"


def request_cells(request: RequestView, palette: Palette | None = None, live: bool = True) -> tuple[Text, ...]:
    """The cells of one request's row, in COLUMNS order; a request no longer live is dimmed."""
    muted = role_style(palette, "muted")
    dim = "" if live else "dim"
    status_style = role_style(palette, STATUS_ROLES.get(request.status, "accent"), "bold" if live else "dim")
    return (
        Text(short_id(request.request_id), style="bold" if live and request.fed else dim),
        Text(request.status + (f" ↺{request.requeued}" if request.requeued else ""), style=status_style),
        Text(request.phase or "-", style=muted if not request.phase else dim),
        Text(f"{request.fed}/{request.held}", justify="right", style=dim),
        Text(f"{request.prompt_length}+{request.generated}", justify="right", style=dim),
        Text(
            str(request.prefix_hit),
            justify="right",
            style=role_style(palette, "success") if request.prefix_hit else muted,
        ),
        Text(
            str(request.recomputed),
            justify="right",
            style=role_style(palette, "warning", "bold") if request.recomputed else muted,
        ),
        Text(format_blocks(request.blocks), style=dim),
        Text(str(request.shared), justify="right", style=role_style(palette, "accent") if request.shared else muted),
    )


class RequestRow(NamedTuple):
    key: str
    request_id: str
    cells: tuple[Text, ...]


def kept_requests(
    previous: tuple[RequestView, ...],
    live: tuple[RequestView, ...],
    limit: int = KEPT_DEPARTED,
    latest: Mapping[str, RequestView] | None = None,
) -> tuple[RequestView, ...]:
    """The requests shown before that this step no longer lists (finished, failed, evicted), newest first, at
    most `limit`: a request that finished between two repaints still shows how it ended (`latest`: each
    request's newest view from every step, painted or not). O(requests)."""
    live_ids = {request.request_id for request in live}
    latest = latest or {}
    departed = (latest.get(request.request_id, request) for request in previous if request.request_id not in live_ids)
    # one last seen decoding is not shown as still decoding: it left the scheduler, its end unseen
    return tuple(
        request if request.status in ("finished", "failed", "left") else replace(request, status="left", phase="")
        for request in departed
    )[:limit]


def request_rows(
    live: tuple[RequestView, ...], departed: tuple[RequestView, ...] = (), palette: Palette | None = None
) -> list[RequestRow]:
    """The live requests (packing order: this forward's first), then the departed ones, dimmed."""
    rows = [RequestRow(f"req-{r.request_id}", r.request_id, request_cells(r, palette)) for r in live]
    rows += [RequestRow(f"req-{r.request_id}", r.request_id, request_cells(r, palette, live=False)) for r in departed]
    return rows


def request_row(snapshot: StepSnapshot, request_id: str) -> int | None:
    """The batch row that fed `request_id` in this step (None: this forward did not feed it). O(rows)."""
    for index, row in enumerate(snapshot.rows or ()):
        if row.request_id == request_id:
            return index
    return None


def find_request(snapshot: StepSnapshot | None, request_id: str | None) -> RequestView | None:
    if snapshot is None or request_id is None:
        return None
    return next((r for r in snapshot.requests or () if r.request_id == request_id), None)


def for_request(snapshot: StepSnapshot, request_id: str) -> StepSnapshot:
    """The step seen from one request (the row picker, by request id). A request this forward did not feed has
    no row here: its tokens, positions and top-k are left empty rather than shown from another request or an
    older step (the cursor pane says why)."""
    row = request_row(snapshot, request_id)
    if row is not None:
        return snapshot.for_row(row)
    return replace(snapshot, input_ids=(), positions=(), topk=(), topk_processed=(), buffer=TokenBuffer([]), row=-1)


def describe_request(
    request: RequestView | None, request_id: str, fed: bool, step: int, palette: Palette | None = None
) -> Text:
    """The cursor pane's request line: 'request r2 · decoding · decode · fed 1 · holds 38 (prompt 30 + 8) ·
    hit 16 · blocks 3 [0-2]'; one not fed in this step says so."""
    text = Text()
    muted = role_style(palette, "muted")
    text.append("request ", style=muted)
    text.append(request_id, style="bold")
    if request is None:
        text.append(f" · not live at step {step} (finished or gone): nothing of it to show", style=muted)
        return text
    text.append(" · ")
    text.append(request.status, style=role_style(palette, STATUS_ROLES.get(request.status, "accent"), "bold"))
    if not fed:
        text.append(
            f" · not fed in step {step}: its cache and top-k are not shown", style=role_style(palette, "warning")
        )
        return text
    text.append(f" · {request.phase or '-'} · fed {request.fed} · holds {request.held}", style="")
    text.append(f" (prompt {request.prompt_length} + {request.generated})", style=muted)
    if request.prefix_hit:
        text.append(f" · hit {request.prefix_hit}", style=role_style(palette, "success"))
    if request.recomputed:
        text.append(f" · recomputed {request.recomputed}", style=role_style(palette, "warning", "bold"))
    if request.requeued:
        text.append(
            f" · sent back to waiting {request.requeued}× (computed again {request.reprefilled})",
            style=role_style(palette, "warning"),
        )
    if request.blocks:
        text.append(f" · blocks {format_blocks(request.blocks, width=48)}", style=muted)
    if request.shared:
        text.append(f" ({request.shared} shared)", style=role_style(palette, "accent"))
    return text


def picked_request(
    step: StepSnapshot | None, shown: StepSnapshot | None, picked: str | None, palette: Palette | None = None
) -> tuple[StepSnapshot | None, Text | None]:
    """What the cache, cursor and top-k panes show of a packed step, with the cursor pane's request line: the
    picked request (`picked`), else the source's row (`shown`, the driver's pick) named by its request. A step
    that packed nothing: `shown` as it is, no line. O(requests)."""
    if step is None or shown is None or step.requests is None:
        return shown, None
    request_id = picked
    if request_id is not None:
        shown = for_request(step, request_id)
    elif shown.rows and 0 <= shown.row < len(shown.rows):
        request_id = shown.rows[shown.row].request_id
    if request_id is None:
        return shown, None
    fed = request_row(step, request_id) is not None
    return shown, describe_request(find_request(step, request_id), request_id, fed, step.step, palette)


class RequestsPane(ThemedPane, Vertical):
    """The requests of a packed forward; the highlighted one is what the cache, cursor and top-k panes show."""

    DEFAULT_CSS = """
    RequestsPane {
        height: auto;
        max-height: 10;
        border: round $primary;
        border-title-color: $primary;
    }
    RequestsPane:focus-within {
        border: round $accent;
    }
    RequestsPane > DataTable {
        height: auto;
        max-height: 8;
    }
    """

    class RequestSelected(Message):
        """The user moved the row cursor to (or pressed enter on) a request."""

        def __init__(self, request_id: str) -> None:
            super().__init__()
            self.request_id = request_id

    def __init__(self, *, name: str | None = None, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.border_title = "requests"
        self._snapshot: StepSnapshot | None = None
        self._departed: tuple[RequestView, ...] = ()
        self._rows: list[RequestRow] = []
        self._shown_columns: list[int] = list(range(len(COLUMNS)))
        self._selected: str | None = None  # the request the user picked (None: the driver's row)
        self._syncing = False  # the table is being rewritten: its cursor events are not the user's
        self._ready = False

    def compose(self) -> ComposeResult:
        table: DataTable = DataTable(id="requests-table", cursor_type="row", zebra_stripes=True)
        for key, label in COLUMNS:
            table.add_column(label, key=key)
        yield table

    def on_mount(self) -> None:
        self._ready = True
        self.follow_theme()
        if self._snapshot is not None:
            self._refresh_table(force=True)

    def repaint_theme(self) -> None:
        self._refresh_table(force=True)

    # -- public API -----------------------------------------------------------------------------

    @property
    def table(self) -> DataTable:
        return self.query_one("#requests-table", DataTable)

    @property
    def palette(self) -> Palette:
        return self._palette

    @property
    def selected_request(self) -> str | None:
        """The request the user picked (arrows, click, n); None until they pick one."""
        return self._selected

    @property
    def request_ids(self) -> list[str]:
        """The requests listed, in order (live first, then departed)."""
        return [row.request_id for row in self._rows]

    def show(self, snapshot: StepSnapshot | None, latest: Mapping[str, RequestView] | None = None) -> None:
        """A new step: its live requests, and those that left since the last one shown (a step back: none; the
        same step again, another request picked: as they were). `latest`: each request's newest view (the app
        sees every step; this pane only the painted ones)."""
        previous = self._snapshot
        if snapshot is None or previous is None or snapshot.step < previous.step:
            self._departed = ()
        elif snapshot.step > previous.step:
            shown = (*(previous.requests or ()), *self._departed)
            self._departed = kept_requests(shown, snapshot.requests or (), latest=latest)
        self._snapshot = snapshot
        self.border_title = f"requests · {len(snapshot.requests or ())} live" if snapshot is not None else "requests"
        if self._ready:
            self._refresh_table()

    def select_request(self, request_id: str) -> None:
        """Pick `request_id` (if listed): the cursor moves to it and RequestSelected is posted."""
        if request_id in self.request_ids:
            self._selected = request_id
            self.table.move_cursor(row=self.request_ids.index(request_id))
            self.post_message(self.RequestSelected(request_id))

    def select_next(self) -> str | None:
        """Pick the request after the selected one (the first after the last); None with none listed."""
        ids = self.request_ids
        if not ids:
            return None
        current = ids.index(self._selected) if self._selected in ids else self.table.cursor_row
        self.select_request(ids[(current + 1) % len(ids)])
        return self._selected

    # -- internals ------------------------------------------------------------------------------

    def on_resize(self) -> None:
        if self._ready:
            self._refresh_table()

    def _refresh_table(self, force: bool = False) -> None:
        snapshot = self._snapshot
        new_rows = request_rows(snapshot.requests or () if snapshot else (), self._departed, self._palette)
        width = self.content_size.width
        labels = [label for _, label in COLUMNS]
        shown = (
            fit_columns(labels, [row.cells for row in new_rows], PRIORITY, width - 1)
            if width > 0
            else list(range(len(COLUMNS)))
        )
        table = self.table
        self._syncing = True
        try:
            if shown != self._shown_columns:
                table.clear(columns=True)
                for i in shown:
                    table.add_column(COLUMNS[i][1], key=COLUMNS[i][0])
                self._shown_columns, self._rows, force = shown, [], True
            new_rows = [row._replace(cells=tuple(row.cells[i] for i in shown)) for row in new_rows]
            ids = [row.request_id for row in new_rows]
            cursor = ids.index(self._selected) if self._selected in ids else None
            update_rows(table, self._rows, new_rows, [COLUMNS[i][0] for i in shown], force=force, cursor=cursor)
            if cursor is not None and table.cursor_row != cursor:
                table.move_cursor(row=cursor, scroll=False)
        finally:
            self._syncing = False
        self._rows = new_rows

    def _picked(self, row: int) -> None:
        if self._syncing or not 0 <= row < len(self._rows):
            return
        request_id = self._rows[row].request_id
        if request_id != self._selected:
            self._selected = request_id
            self.post_message(self.RequestSelected(request_id))

    @on(DataTable.RowHighlighted, "#requests-table")
    def _row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()
        if self.table.has_focus:  # the user moved it (arrows, click): a rebuild's cursor is not a pick
            self._picked(event.cursor_row)

    @on(DataTable.RowSelected, "#requests-table")
    def _row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self._picked(event.cursor_row)

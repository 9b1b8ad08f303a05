"""The top-k pane: the step's candidate next tokens as probability bars, and the watched tokens.

`topk_rows(snapshot, mode)` and `render_header(snapshot, mode)` are pure (testable without an
App). By default the pane shows the distribution after the sampler's processors, with the raw
probability of each token in a small column; `t` toggles to the raw distribution (the small column
then shows the processed probability). `f` or enter on a row posts `TopKPane.Force`. O(k) per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import DataTable

from kvtui.engine.records.snapshot import StepSnapshot, TopToken
from kvtui.fmt import token_text
from kvtui.widgets.shared.live_text import LiveText
from kvtui.widgets.shared.palette import Palette, ThemedPane, role_style
from kvtui.widgets.shared.table_rows import fit_columns, update_rows
from kvtui.widgets.step.token_pieces import open_character, token_label

Mode = Literal["processed", "raw"]
MODES: tuple[Mode, Mode] = ("processed", "raw")

BAR_WIDTH = 12
PIECE_WIDTH = 24
MIN_PIECE_WIDTH = 6
# columns a narrow pane keeps, most important first: the token and its probability before the rest
PRIORITY = (0, 2, 4, 1, 5, 3, 6, 7)
CHOSEN_MARK = "▶"
WATCHED_MARK = "◇"


def columns(mode: Mode) -> tuple[tuple[str, str], ...]:
    """(key, label) of the table's columns; the 'other' column is the other distribution."""
    return (
        ("mark", " "),
        ("rank", "#"),
        ("token", "token"),
        ("id", "id"),
        ("prob", "prob"),
        ("bar", mode),
        ("other", "raw" if mode == "processed" else "proc"),
        ("logit", "logit"),
    )


def format_piece(text: str, width: int = PIECE_WIDTH) -> str:
    """The token's text as every pane shows it (fmt.token_text), quoted and cut to `width`."""
    return f"'{cut(token_text(text), width)}'"


def cut(body: str, width: int, middle: bool = False) -> str:
    """`body` in at most `width` characters: its end cut to `…`, or (`middle`) its middle, keeping its end."""
    if len(body) <= width:
        return body
    if not middle or width < 4:
        return body[: max(1, width - 1)] + "…"
    head = width // 2
    return body[:head] + "…" + body[len(body) - (width - 1 - head) :]


def abbreviate(bodies: list[str], width: int) -> list[str]:
    """The labels cut to `width` so that different ones stay different: the end cut where that keeps them
    apart, else the middle (' comm…' twice becomes ' co…and' and ' co…ent'), else wider, up to PIECE_WIDTH."""
    distinct = len(set(bodies))
    for size in range(width, max(width, PIECE_WIDTH) + 1):
        for middle in (False, True):
            shown = [cut(b, size, middle) for b in bodies]
            if len(set(shown)) == distinct:
                return shown
    return [cut(b, PIECE_WIDTH) for b in bodies]


def candidate_bodies(snapshot: StepSnapshot, tokens: Sequence[TopToken]) -> list[str]:
    """Each candidate as the buffer would show it: a piece of a character as its bytes (`⟨e4 bd⟩`); where the
    cache ends inside a character that a candidate completes, what it becomes (`⟨bd a0⟩→你`). O(k)."""
    table = snapshot.token_bytes
    if not table:
        return [token_text(t.text) for t in tokens]
    begun = open_character(snapshot.buffer, table)
    bodies = []
    for token in tokens:
        body = token_label(token.id, token.text, table)
        if begun:
            whole = (begun + table.get(token.id, token.text.encode())).decode("utf-8", errors="replace")
            if "\ufffd" not in whole:
                body += f"→{token_text(whole)}"
        bodies.append(body)
    return bodies


def format_prob(p: float) -> str:
    """0.4213 -> '42.1%', 0.0012 -> '0.12%', 3e-7 -> '<0.01%', 0 -> '0%'."""
    pct = p * 100
    if pct >= 1 or pct == 0:
        return f"{pct:.1f}%" if pct else "0%"
    if pct >= 0.01:
        return f"{pct:.2f}%"
    return "<0.01%"


def format_logit(logit: float) -> str:
    return "-inf" if logit <= -1e30 else f"{logit:.2f}"


def prob_bar(p: float, width: int = BAR_WIDTH) -> str:
    """A left-aligned bar of `width` cells in eighths, padded with spaces."""
    eighths = round(min(max(p, 0.0), 1.0) * width * 8)
    full, part = divmod(eighths, 8)
    bar = "█" * full + ("▏▎▍▌▋▊▉"[part - 1] if part else "")
    return bar.ljust(width)


class TopKRow(NamedTuple):
    key: str  # row key: "top-<i>" or "watch-<i>" (position, so rows are reused step to step)
    token: TopToken
    watched: bool  # a row of the watched list (below the top-k)
    cells: tuple[Text, ...]


def _cells(
    token: TopToken,
    rank: int,
    *,
    other: TopToken | None,
    chosen: bool,
    forced: bool,
    watched_row: bool,
    is_watched: bool,
    palette: Palette | None,
    body: str,
) -> tuple[Text, ...]:
    bold = "bold" if chosen else ""
    mark = (CHOSEN_MARK if chosen else " ") + (WATCHED_MARK if is_watched else " ")
    piece = f"'{body}'"
    if chosen and forced:
        piece += " (forced)"
    bar_role = "accent" if chosen else "muted" if watched_row else "primary"
    return (
        Text(mark, style=role_style(palette, "accent", "bold")),
        Text(
            f"#{rank}" if watched_row else str(rank),
            justify="right",
            style=role_style(palette, "muted") if watched_row else "",
        ),
        Text(piece, style=role_style(palette, "accent", bold) if chosen else ""),
        Text(str(token.id), justify="right", style=bold),
        Text(format_prob(token.prob), justify="right", style=bold),
        Text(prob_bar(token.prob), style=role_style(palette, bar_role)),
        Text("·" if other is None else format_prob(other.prob), justify="right", style=role_style(palette, "muted")),
        Text(format_logit(token.logit), justify="right", style=role_style(palette, "muted")),
    )


def topk_rows(
    snapshot: StepSnapshot | None,
    mode: Mode = "processed",
    palette: Palette | None = None,
    piece_width: int = PIECE_WIDTH,
) -> list[TopKRow]:
    """The top-k rows of `mode` then one row per watched token (pieces cut to `piece_width`). O(k + watched)."""
    if snapshot is None:
        return []
    shown, other = (
        (snapshot.topk_processed, snapshot.topk) if mode == "processed" else (snapshot.topk, snapshot.topk_processed)
    )
    other_by_id = {t.id: t for t in other}
    watched_ids = {t.id for t in snapshot.watched}
    chosen_id = None if snapshot.chosen is None else snapshot.chosen.id
    forced = snapshot.chosen_forced
    bodies = abbreviate(candidate_bodies(snapshot, [*shown, *snapshot.watched]), piece_width)
    rows = []
    for i, token in enumerate(shown):
        rank = token.rank or i + 1
        cells = _cells(
            token,
            rank,
            other=other_by_id.get(token.id),
            chosen=token.id == chosen_id,
            forced=forced,
            watched_row=False,
            is_watched=token.id in watched_ids,
            palette=palette,
            body=bodies[i],
        )
        rows.append(TopKRow(f"top-{i}", token, False, cells))
    # Watched tokens are measured on the processed distribution; their rank is their own.
    for i, token in enumerate(snapshot.watched):
        cells = _cells(
            token,
            token.rank,
            other=None,
            chosen=token.id == chosen_id,
            forced=forced,
            watched_row=True,
            is_watched=True,
            palette=palette,
            body=bodies[len(shown) + i],
        )
        rows.append(TopKRow(f"watch-{i}", token, True, cells))
    return rows


def render_header(
    snapshot: StepSnapshot | None, mode: Mode = "processed", palette: Palette | None = None, width: int | None = None
) -> Text:
    """'processed (t: raw) · chosen ▶ ' the' 262 42.1% (forced)'."""
    # what matters first (the mode, the chosen token), so a narrow pane cuts the hints, never the token
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(mode, style=role_style(palette, "accent", "bold"))
    if snapshot is None:
        text.append(" · no step yet", style=role_style(palette, "muted"))
        return text
    chosen = snapshot.chosen
    if chosen is None:
        text.append(" · nothing chosen", style=role_style(palette, "muted"))
    else:
        text.append(" · ", style=role_style(palette, "muted"))
        body = cut(candidate_bodies(snapshot, [chosen])[0], PIECE_WIDTH)
        text.append(f"{CHOSEN_MARK} '{body}'", style=role_style(palette, "accent", "bold"))
        text.append(f" {format_prob(chosen.prob)}")
        if snapshot.chosen_forced:
            text.append(" (forced)", style=role_style(palette, "warning", "bold"))
        text.append(f" id {chosen.id}", style=role_style(palette, "muted"))
        if chosen.rank:
            text.append(f" rank {chosen.rank}", style=role_style(palette, "muted"))
    if snapshot.watched:
        text.append(f" · {WATCHED_MARK} watched {len(snapshot.watched)}", style=role_style(palette, "muted"))
    text.append(f" · t: {'raw' if mode == 'processed' else 'processed'}", style=role_style(palette, "muted"))
    if width is not None and text.cell_len > width and chosen is not None:
        # a narrow pane (80 columns): the chosen token whole, then the mode (its probability is in its row); a cut
        # takes the end, never the token
        short = Text(no_wrap=True, overflow="ellipsis")
        short.append(f"{CHOSEN_MARK} '{body}'", style=role_style(palette, "accent", "bold"))
        if snapshot.chosen_forced:
            short.append(" forced", style=role_style(palette, "warning", "bold"))
        short.append(f" {'proc' if mode == 'processed' else mode}", style=role_style(palette, "accent"))
        return short
    return text


class TopKPane(ThemedPane, Vertical):
    """Top-k bars (processed or raw), the chosen token, watched tokens; posts Force."""

    BINDINGS = [
        Binding("f", "force", "Force token"),
        Binding("t", "toggle_mode", "Raw/processed"),
    ]

    DEFAULT_CSS = """
    TopKPane {
        height: 1fr;
        border: round $primary;
        border-title-color: $primary;
    }
    TopKPane:focus-within {
        border: round $accent;
    }
    TopKPane > #topk-header {
        height: 1;
        padding: 0 1;
        color: $text-muted;
    }
    TopKPane > DataTable {
        height: 1fr;
    }
    """

    class Force(Message):
        """The user asked to force this alternative as the next token."""

        def __init__(self, token_id: int, text: str) -> None:
            super().__init__()
            self.token_id = token_id
            self.text = text

    def __init__(
        self, *, mode: Mode = "processed", name: str | None = None, id: str | None = None, classes: str | None = None
    ) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.border_title = "top-k"
        self._mode: Mode = mode
        self._snapshot: StepSnapshot | None = None
        self._rows: list[TopKRow] = []
        self._shown_columns: list[int] = list(range(len(columns(mode))))  # what the table has, by index
        self._ready = False

    def compose(self) -> ComposeResult:
        yield LiveText(render_header(None, self._mode), id="topk-header")
        table: DataTable = DataTable(id="topk-table", cursor_type="row")
        self._add_columns(table)
        yield table

    def _add_columns(self, table: DataTable) -> None:
        for key, label in columns(self._mode):
            table.add_column(label, key=key)

    def on_mount(self) -> None:
        self._ready = True  # is_mounted only turns True after on_mount returns
        self.follow_theme()
        self._refresh(force=True)

    def repaint_theme(self) -> None:
        self._refresh(force=True)

    # -- public API -----------------------------------------------------------------------------

    @property
    def table(self) -> DataTable:
        return self.query_one("#topk-table", DataTable)

    @property
    def mode(self) -> Mode:
        return self._mode

    @mode.setter
    def mode(self, mode: Mode) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        if mode == self._mode:
            return
        self._mode = mode
        if self._ready:
            table = self.table
            cursor = table.cursor_row
            table.clear(columns=True)
            self._add_columns(table)
            self._shown_columns = list(range(len(columns(mode))))
            self._rows = []
            self._refresh(cursor=cursor)

    @property
    def selected_token(self) -> TopToken | None:
        if not self._ready:
            return None
        row = self.table.cursor_row
        return self._rows[row].token if 0 <= row < len(self._rows) else None

    @property
    def selected_token_id(self) -> int | None:
        token = self.selected_token
        return None if token is None else token.id

    def show(self, snapshot: StepSnapshot | None) -> None:
        self._snapshot = snapshot
        if self._ready:
            self._refresh()

    def action_toggle_mode(self) -> None:
        self.mode = "raw" if self._mode == "processed" else "processed"

    def action_force(self) -> None:
        token = self.selected_token
        if token is not None:
            self.post_message(self.Force(token.id, token.text))

    # -- internals ------------------------------------------------------------------------------

    def on_resize(self) -> None:
        if self._ready:
            self._refresh()

    def _refresh(self, force: bool = False, cursor: int | None = None) -> None:
        """Show the step's rows in the columns that fit the pane: a narrow pane keeps the token and its
        probability (PRIORITY) and cuts long pieces shorter; a wide one shows every column."""
        width = self.content_size.width
        piece_width = PIECE_WIDTH if width <= 0 else max(MIN_PIECE_WIDTH, min(PIECE_WIDTH, width - 18))
        new_rows = topk_rows(self._snapshot, self._mode, self._palette, piece_width)
        all_columns = columns(self._mode)
        shown = (
            list(range(len(all_columns)))
            if width <= 0
            else fit_columns([label for _, label in all_columns], [r.cells for r in new_rows], PRIORITY, width - 1)
        )
        table = self.table
        if shown != self._shown_columns:
            cursor = table.cursor_row if cursor is None else cursor
            table.clear(columns=True)
            for i in shown:
                key, label = all_columns[i]
                table.add_column(label, key=key)
            self._shown_columns, self._rows, force = shown, [], True
        new_rows = [row._replace(cells=tuple(row.cells[i] for i in shown)) for row in new_rows]
        # Every column as wide as this step's widest cell, not as the widest of the steps shown before it
        # (no widen_only): a step looks the same whether replay played through it or opened at it.
        update_rows(table, self._rows, new_rows, [all_columns[i][0] for i in shown], force=force, cursor=cursor)
        self._rows = new_rows
        header = render_header(self._snapshot, self._mode, self._palette, width - 2 if width > 0 else None)
        self.query_one("#topk-header", LiveText).show_text(header)

    @on(DataTable.RowSelected, "#topk-table")
    def _row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        if 0 <= event.cursor_row < len(self._rows):
            token = self._rows[event.cursor_row].token
            self.post_message(self.Force(token.id, token.text))

    @on(DataTable.RowHighlighted, "#topk-table")
    def _row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()

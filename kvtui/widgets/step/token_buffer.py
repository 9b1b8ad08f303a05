"""The token buffer pane: every token in the KV cache, in order, each with its position.

The buffer can hold 100k+ tokens, so the pane is a Line API widget (`ScrollView` + `render_line`)
laid out on a *fixed grid*: every token occupies `cell_width` cells (its piece, truncated with `…`,
plus a one-cell separator), and each row holds `cols = (width - gutter) // cell_width` tokens. So
row `r` holds buffer indices `r * cols .. r * cols + cols - 1`, the virtual height is
`ceil(slots / cols)`, and nothing ever has to measure or wrap tokens that are not on screen:

* `show(snapshot)` is O(1): it stores the snapshot and sets `virtual_size` (one `len()` and one
  `buffer[-1]` for the gutter width).
* `render_line(y)` reads only the `cols` tokens of the row at `scroll_y + y`.
* Selection, clicks and key moves are arithmetic on the grid.

Special tokens are never cut: the cell width grows to the widest special token piece seen (up to
SPECIAL_CELL), found among the newest SCAN_NEW tokens at each `show` and among the tokens of every row drawn
(a wider one drawn relayouts the grid once). Ordinary pieces are cut with `…` as before.

After the last token comes a ghost cell: `▌` plus the pending (chosen, not yet cached) token, in the
cursor style, at `snapshot.cursor`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from rich.cells import cell_len
from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding, BindingType
from textual.geometry import Size
from textual.message import Message
from textual.reactive import Reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

from ...engine.records.snapshot import ORIGINS, BufferToken, LayerInfo, StepSnapshot
from ...fmt import token_text as display_piece
from .token_grid import (
    BUFFER_CSS,
    CURSOR_GLYPH,
    EMPTY_TEXT,
    ORIGIN_STYLES,
    SPECIAL_CELL,
    SPECIAL_STYLE,
    Grid,
    buffer_snapshot,
    buffer_title,
    compute_grid,
    describe_token,
    fit,
    pending_label,
    render_strip,
)
from .token_pieces import piece_labels

__all__ = ["ORIGIN_STYLES", "SPECIAL_STYLE", "TokenBufferPane", "display_piece", "fit", "render_strip"]

SEPARATOR = "│"
MIN_CELL, MAX_CELL = 4, 25  # cell width incl. separator: a piece shows at most 24 cells
SCAN_NEW = 1024  # newest tokens a show() looks at for special-token widths (the rest: when they are drawn)
ATTENTION_LEVELS = 8  # attention weights are quantized so shaded styles stay cacheable


class TokenBufferPane(ScrollView, can_focus=True):
    """Every token in the cache, on a virtualized fixed grid, with selection and cursor."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "token-buffer--gutter",
        "token-buffer--separator",
        "token-buffer--empty",
        "token-buffer--special",
        *(f"token-buffer--{origin}" for origin in ORIGINS),
        "token-buffer--cursor",
        "token-buffer--last-forward",
        "token-buffer--evicted",
        "token-buffer--selected",
        "token-buffer--attention",
    }

    DEFAULT_CSS = BUFFER_CSS

    # A new row of tokens changes this pane's scroll range and nothing else: its region is set by the panes
    # around it and its vertical scrollbar is always shown. Widget's virtual_size asks for a screen-wide layout
    # pass at every change (a new row every few steps while the model runs, tens of ms of CPU on a 160x48
    # screen that the engine process could use on 2 cores), so this one only updates the scrollbar.
    virtual_size: Reactive[Size] = Reactive(Size(0, 0), layout=False)

    def watch_virtual_size(self, size: Size) -> None:
        self._scroll_update(size)  # the scrollbar's range and thumb; scroll offsets clamped to the new range

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("left", "move(-1)", "Previous token", show=False),
        Binding("right", "move(1)", "Next token", show=False),
        Binding("up", "move_rows(-1)", "Row up", show=False),
        Binding("down", "move_rows(1)", "Row down", show=False),
        Binding("pageup", "move_pages(-1)", "Page up", show=False),
        Binding("pagedown", "move_pages(1)", "Page down", show=False),
        Binding("home", "select_first", "First token", show=False),
        Binding("end", "select_last", "Last token", show=False),
    ]

    @dataclass
    class Selected(Message):
        """A token was selected (by key, click or `select()`)."""

        index: int  # buffer index
        token: BufferToken
        pane: TokenBufferPane | None = None

        @property
        def control(self) -> TokenBufferPane | None:
            return self.pane

    empty_text = EMPTY_TEXT  # what the pane says before the first step: the screen sets its source's words

    def __init__(
        self,
        *,
        cell_width: int = 10,
        auto_title: bool = True,
        name: str | None = None,
        id: str | None = None,
        classes: str | None = None,
        disabled: bool = False,
    ) -> None:
        super().__init__(name=name, id=id, classes=classes, disabled=disabled)
        self._cell_width = max(MIN_CELL, min(MAX_CELL, cell_width))
        self.auto_title = auto_title
        self._snapshot: StepSnapshot | None = None
        self._selected: int | None = None
        self._selected_layer: int | None = None
        self._attention: Sequence[float] | None = None
        self._special_width = 0  # cells of the widest special token piece seen in this buffer
        self._scanned = 0  # buffer tokens looked at for it
        self._grid = self._compute_grid(0)
        self._height = 0
        self._styles: dict[tuple, Style] = {}

    # ------------------------------------------------------------------ public API

    @property
    def snapshot(self) -> StepSnapshot | None:
        return self._snapshot

    @property
    def selected_index(self) -> int | None:
        return self._selected

    @property
    def selected_layer(self) -> int | None:
        """Layer whose evictions are greyed out (`None`: none)."""
        return self._selected_layer

    @selected_layer.setter
    def selected_layer(self, index: int | None) -> None:
        if index != self._selected_layer:
            self._selected_layer = index
            self._update_subtitle()
            self.refresh()

    @property
    def attention(self) -> Sequence[float] | None:
        """Optional per-buffer-index weights in 0..1 that shade token backgrounds."""
        return self._attention

    @attention.setter
    def attention(self, weights: Sequence[float] | None) -> None:
        self._attention = weights
        self.refresh()

    @property
    def cell_width(self) -> int:
        return self._cell_width

    @cell_width.setter
    def cell_width(self, value: int) -> None:
        self._cell_width = max(MIN_CELL, min(MAX_CELL, value))
        self._relayout()

    def show(self, snapshot: StepSnapshot | None) -> None:
        """Display a snapshot (or nothing). O(1) apart from repainting the visible lines."""
        old = self._snapshot
        old_count = 0 if old is None else len(old.buffer)
        self._snapshot = snapshot
        count = 0 if snapshot is None else len(snapshot.buffer)
        selected = self._selected
        follow = selected is None or selected >= old_count - 1
        clamped = False
        self._scan_specials(snapshot, count)
        if count == 0:
            self._selected = None
        elif selected is not None and (selected >= count or (follow and count > old_count)):
            # rewound below the selection, or tail-following: keep the selection on the last token
            clamped = True
            self._select(count - 1, scroll=False)
        self._relayout()
        if follow and self.is_mounted:  # (before mount, the first on_resize scrolls to the tail)
            self.scroll_end(animate=False, immediate=True, x_axis=False)
        elif clamped:
            self._scroll_to_index(count - 1)
        self._update_subtitle()

    def _scan_specials(self, snapshot: StepSnapshot | None, count: int) -> None:
        """Widen for the special tokens among the newest SCAN_NEW tokens not looked at yet. O(SCAN_NEW)."""
        if count == 0:
            self._special_width = self._scanned = 0
            return
        start = max(min(self._scanned, count), count - SCAN_NEW)
        buffer = snapshot.buffer  # type: ignore[union-attr]
        for index in range(start, count):
            token = buffer[index]
            if token.special:
                self._special_width = max(self._special_width, cell_len(display_piece(token.piece)))
        self._scanned = count

    def show_buffer(
        self,
        buffer: Sequence[BufferToken],
        cursor: int | None = None,
        last_forward_count: int = 0,
        pending_text: str | None = None,
        layers: tuple[LayerInfo, ...] = (),
    ) -> None:
        """Convenience for callers without a StepSnapshot (e.g. a trace viewer)."""
        self.show(buffer_snapshot(buffer, cursor, last_forward_count, pending_text, layers))

    def select(self, index: int | None) -> None:
        """Select buffer index `index` (clamped), scroll it into view and post `Selected`."""
        count = self._grid.count
        if index is None or count == 0:
            if self._selected is not None:
                self._selected = None
                self._update_subtitle()
                self.refresh()
            return
        self._select(max(0, min(count - 1, index)), scroll=True)

    def describe(self, index: int | None = None) -> str:
        """One line about a token: `pos 123 · id 4567 · '<|im_start|>' · template · turn 2 · special`."""
        snapshot = self._snapshot
        return describe_token(snapshot, self._selected if index is None else index, snapshot and self._layer(snapshot))

    def visible_range(self) -> range:
        """Buffer indices on screen (for tests and for a later attention fetch)."""
        grid = self._grid
        first_row = self.scroll_offset.y
        height = max(1, self.scrollable_content_region.height)
        return range(min(grid.count, first_row * grid.cols), min(grid.count, (first_row + height) * grid.cols))

    # ------------------------------------------------------------------ layout

    def _compute_grid(self, width: int) -> Grid:
        return compute_grid(self._snapshot, width, self._cell_width, self._special_width)

    def _relayout(self) -> None:
        width = self.scrollable_content_region.width
        self._grid = grid = self._compute_grid(width)
        self._height = self.scrollable_content_region.height
        self.virtual_size = Size(width, grid.rows)
        self.refresh()

    def on_mount(self) -> None:
        self._update_subtitle()
        self._relayout()

    def on_resize(self, event: events.Resize) -> None:
        old, old_height = self._grid, self._height
        # the cursor's row (the last) was in view: Textual may already have clamped the offset to the new height
        # under the old row count (a taller, narrower pane), so both heights count
        height = max(old_height, self.scrollable_content_region.height)
        at_end = old.width == 0 or self.scroll_offset.y + height >= old.rows
        self._relayout()
        if at_end:  # keep following the tail (also: the first layout after a show() before mount)
            self.scroll_end(animate=False, immediate=True, x_axis=False)
        if self._selected is not None:  # and the selection in view (it wins when both do not fit)
            self._scroll_to_index(self._selected)

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._styles.clear()

    # ------------------------------------------------------------------ styles

    def _style(self, names: tuple[str, ...], shade: int = 0) -> Style:
        """Layer component styles: backgrounds composite, later colors win, text styles add up."""
        key = (names, shade, self.has_focus)
        style = self._styles.get(key)
        if style is not None:
            return style
        background = self.background_colors[1]
        color = self.colors[3]
        text = Style()
        for name in names:
            component = self.get_component_styles(name)
            if component.has_rule("background"):
                background = background + component.background
            if component.has_rule("color"):
                color = component.color
            if component.has_rule("text_style"):
                text += component.text_style
        if shade:
            tint = self.get_component_styles("token-buffer--attention").background
            background = background.blend(tint.with_alpha(1.0), tint.a * shade / ATTENTION_LEVELS)
        style = (
            Style(
                color=(background + color).rich_color if color.a else None,
                bgcolor=background.rich_color if background.a else None,
            )
            + text
        )
        self._styles[key] = style
        return style

    @staticmethod
    def _last_forward_start(snapshot: StepSnapshot) -> int:
        return len(snapshot.buffer) - len(snapshot.input_ids)

    def _layer(self, snapshot: StepSnapshot) -> LayerInfo | None:
        index = self._selected_layer
        if index is None:
            return None
        layers = snapshot.layers
        if 0 <= index < len(layers) and layers[index].index == index:
            return layers[index]
        return next((layer for layer in layers if layer.index == index), None)

    # ------------------------------------------------------------------ rendering

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        grid = self._grid
        if grid.width != width:  # rendered before on_resize caught up
            grid = self._compute_grid(width)
            self.call_later(self._relayout)
        return self._render_row(self.scroll_offset.y + y, grid)

    def _render_row(self, row: int, grid: Grid) -> Strip:
        width = grid.width
        base = self._style(())
        snapshot = self._snapshot
        if snapshot is None or grid.count == 0:
            if row != 0:
                return Strip.blank(width, base)
            return Strip([Segment(fit(" " + self.empty_text, width), self._style(("token-buffer--empty",)))], width)

        first = row * grid.cols
        if row < 0 or first >= grid.slots:
            return Strip.blank(width, base)
        stop = min(first + grid.cols, grid.count)
        buffer = snapshot.buffer
        piece_width = grid.cell - 1
        separator = Segment(SEPARATOR, self._style(("token-buffer--separator",)))

        lf_start = self._last_forward_start(snapshot)
        layer = self._layer(snapshot)
        evicted_before = layer.held_from if layer is not None else 0
        held = layer if layer is not None and layer.held is not None else None  # a compressed cache's layer
        selected = self._selected
        attention = self._attention
        attention_len = len(attention) if attention is not None else 0

        tokens = [buffer[i] for i in range(first, stop)]
        labels = piece_labels(buffer, first, stop, snapshot.token_bytes)
        wider = max((cell_len(display_piece(t.piece)) for t in tokens if t.special), default=0)
        if wider > self._special_width and grid.cell < SPECIAL_CELL:  # a special token the scan did not see
            self._special_width = wider
            self.call_later(self._relayout)
        gutter_position = tokens[0].position if tokens else snapshot.cursor
        segments = [Segment(f"{gutter_position:>{grid.digits}} ", self._style(("token-buffer--gutter",)))]
        for index, token in enumerate(tokens, first):
            names = [f"token-buffer--{token.origin}"] if token.origin in ORIGINS else []
            if token.special:
                names.append("token-buffer--special")
            if index >= lf_start:
                names.append("token-buffer--last-forward")
            if index < evicted_before if held is None else not held.holds(index):
                names.append("token-buffer--evicted")
            if index == selected:
                names.append("token-buffer--selected")
            shade = 0
            if index < attention_len:
                weight = attention[index]  # type: ignore[index]
                shade = max(0, min(ATTENTION_LEVELS, round(weight * ATTENTION_LEVELS)))
            segments.append(Segment(fit(labels[index - first], piece_width), self._style(tuple(names), shade)))
            segments.append(separator)
        if first <= grid.count < first + grid.cols:  # the ghost cell: where the next token goes
            pending = pending_label(snapshot)
            segments.append(Segment(fit(CURSOR_GLYPH + pending, piece_width), self._style(("token-buffer--cursor",))))
        return Strip(segments).adjust_cell_length(width, base)

    # ------------------------------------------------------------------ selection

    def _select(self, index: int, *, scroll: bool) -> None:
        changed = index != self._selected
        self._selected = index
        if scroll:
            self._scroll_to_index(index)
        self._update_subtitle()
        self.refresh()
        if changed and self._snapshot is not None and self.is_attached:
            self.post_message(self.Selected(index, self._snapshot.buffer[index], self))

    def _scroll_to_index(self, index: int) -> None:
        if not self.is_mounted:
            return
        row = index // self._grid.cols
        height = max(1, self.scrollable_content_region.height)
        top = self.scroll_offset.y
        if row < top:
            self.scroll_to(y=row, animate=False, immediate=True)
        elif row >= top + height:
            self.scroll_to(y=row - height + 1, animate=False, immediate=True)

    def _update_subtitle(self) -> None:
        self.border_subtitle = self.describe()
        if self.auto_title:
            snapshot = self._snapshot
            self.border_title = buffer_title(snapshot, self._layer(snapshot) if snapshot is not None else None)

    def _move_to(self, index: int) -> None:
        if self._grid.count:
            self.select(index)

    def _anchor(self) -> int:
        return self._grid.count - 1 if self._selected is None else self._selected

    def action_move(self, delta: int) -> None:
        self._move_to(self._anchor() + delta if self._selected is not None else self._anchor())

    def action_move_rows(self, rows: int) -> None:
        if self._selected is None:
            self._move_to(self._anchor())
        else:  # select() clamps, so a move past either end lands on the first / last token
            self._move_to(self._selected + rows * self._grid.cols)

    def action_move_pages(self, pages: int) -> None:
        page = max(1, self.scrollable_content_region.height - 1)
        if self._selected is None:
            self._move_to(self._anchor())
        else:
            self._move_to(self._selected + pages * page * self._grid.cols)

    def action_select_first(self) -> None:
        self._move_to(0)

    def action_select_last(self) -> None:
        self._move_to(self._grid.count - 1)

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        grid = self._grid
        if offset is None or grid.count == 0:
            return
        column = (offset.x - grid.gutter) // grid.cell
        if offset.x < grid.gutter or column >= grid.cols:
            return
        index = (offset.y + self.scroll_offset.y) * grid.cols + column
        if index < grid.count:
            self.select(index)

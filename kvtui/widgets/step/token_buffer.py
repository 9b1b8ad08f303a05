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
from functools import lru_cache
from typing import ClassVar

from rich.cells import cell_len, set_cell_size
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.binding import Binding, BindingType
from textual.geometry import Size
from textual.message import Message
from textual.reactive import Reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

from ...engine.records.snapshot import ORIGINS, BufferToken, LayerInfo, StepSnapshot, TopToken
from ...fmt import token_text as display_piece

EMPTY_TEXT = "cache empty — send a message"
CURSOR_GLYPH = "▌"
ELLIPSIS = "…"
SEPARATOR = "│"
MIN_CELL, MAX_CELL = 4, 25  # cell width incl. separator: a piece shows at most 24 cells
SPECIAL_CELL = 33  # the grid widens up to this for a special token, so `<|start_header_id|>` is never cut
SCAN_NEW = 1024  # newest tokens a show() looks at for special-token widths (the rest: when they are drawn)
ATTENTION_LEVELS = 8  # attention weights are quantized so shaded styles stay cacheable


@lru_cache(maxsize=16384)
def fit(text: str, width: int) -> str:
    """`text` padded or truncated (with `…`) to exactly `width` cells."""
    if width <= 0:
        return ""
    length = cell_len(text)
    if length <= width:
        return text + " " * (width - length)
    return set_cell_size(text, width - 1) + ELLIPSIS


# The origins' colours as palette roles, for renderers outside Textual (the notebook view): the same roles the
# pane's CSS gives them ($text-primary for user, $text-success for assistant, $text-error for tokenizer-added...).
ORIGIN_STYLES = {
    "template": ("muted", ""),
    "system": ("info", "italic"),
    "user": ("primary", ""),
    "assistant": ("success", ""),
    "forced": ("warning", "underline"),
    "tokenizer-added": ("error", "bold"),
    "primed": ("error", "italic"),
    "fed": ("primary", ""),
    "pad": ("muted", "italic"),
    "unknown": ("muted", "italic"),
}
SPECIAL_STYLE = "bold reverse"  # a special token stands out as a block of its origin's colour


def render_strip(snapshot: StepSnapshot | None, palette=None, limit: int | None = None) -> Text:
    """The buffer as one wrapping Rich Text, for renderers outside Textual: each token as `position piece`,
    coloured by origin, specials in reverse, the positions of the last forward's tokens in bold, then the
    cursor and the pending token after `▌`. `limit`: only the last `limit` tokens (the
    count of the ones left out is said first). O(limit)."""
    from ..shared.palette import role_style

    text = Text(overflow="fold")
    if snapshot is None or len(snapshot.buffer) == 0:
        text.append(EMPTY_TEXT, style="italic")
        return text
    buffer = snapshot.buffer
    count = len(buffer)
    first = 0 if limit is None or count <= limit else count - limit
    if first:
        text.append(f"… {first} earlier tokens … ", style=role_style(palette, "muted", "italic"))
    last_forward = count - len(snapshot.input_ids)
    for index in range(first, count):
        token = buffer[index]
        role, extra = ORIGIN_STYLES.get(token.origin, ("muted", ""))
        style = role_style(palette, role, f"{extra} {SPECIAL_STYLE}".strip() if token.special else extra)
        text.append(f"{token.position}", style=role_style(palette, "muted", "bold" if index >= last_forward else "dim"))
        text.append("\u00a0")  # the position stays with its piece when the line wraps
        text.append(display_piece(token.piece), style=style)
        text.append(" ")
    pending = "" if snapshot.chosen is None else display_piece(snapshot.chosen.text)
    text.append(f"{CURSOR_GLYPH}{snapshot.cursor}\u00a0{pending}", style=role_style(palette, "accent", "bold"))
    return text


@dataclass(frozen=True, slots=True)
class _Grid:
    width: int  # content width the grid was computed for
    digits: int  # gutter digits
    gutter: int  # gutter cells (digits + 1 space)
    cell: int  # cells per token incl. separator
    cols: int  # tokens per row
    count: int  # tokens in the buffer
    slots: int  # count + the ghost cursor cell (0 when there is nothing to show)
    rows: int


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

    DEFAULT_CSS = """
    TokenBufferPane {
        height: 1fr;
        overflow-x: hidden;
        overflow-y: scroll;
        background: $surface;
        color: $foreground;
        border: round $foreground 25%;
        border-title-color: $text-muted;
        border-subtitle-color: $text-accent;
        border-subtitle-align: left;
        &:focus { border: round $accent; }

        & > .token-buffer--gutter { color: $foreground 55%; background: $panel; }
        & > .token-buffer--separator { color: $foreground 18%; }
        & > .token-buffer--empty { color: $foreground 60%; text-style: italic; }

        & > .token-buffer--template { color: $foreground 70%; }
        & > .token-buffer--system { color: $text-secondary; }
        & > .token-buffer--user { color: $text-primary; }
        & > .token-buffer--assistant { color: $text-success; }
        & > .token-buffer--forced { color: $text-warning; text-style: underline; }
        & > .token-buffer--tokenizer-added { color: $text-error; }
        & > .token-buffer--primed { color: $text-error 55%; text-style: italic; }
        & > .token-buffer--unknown { color: $text-disabled; text-style: italic; }
        & > .token-buffer--special { background: $accent 22%; text-style: bold; }

        & > .token-buffer--last-forward { background: $foreground 15%; }
        & > .token-buffer--evicted { color: $text-disabled; text-style: strike; }
        & > .token-buffer--cursor { color: $text-accent; background: $accent 35%; text-style: bold; }
        & > .token-buffer--attention { background: $warning; }
        & > .token-buffer--selected {
            background: $block-cursor-blurred-background;
            color: $block-cursor-blurred-foreground;
            text-style: $block-cursor-blurred-text-style;
        }
        &:focus > .token-buffer--selected {
            background: $block-cursor-background;
            color: $block-cursor-foreground;
            text-style: $block-cursor-text-style;
        }
    }
    """

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
        if cursor is None:
            cursor = buffer[-1].position + 1 if len(buffer) else 0
        chosen = None if pending_text is None else TopToken(id=-1, text=pending_text, logit=0.0, prob=0.0)
        self.show(
            StepSnapshot(
                step=0,
                phase="decode",
                turn=0,
                input_ids=(0,) * last_forward_count,
                positions=(),
                cursor=cursor,
                cache_seq_length=len(buffer),
                capacity=None,
                layers=layers,
                topk=(),
                topk_processed=(),
                watched=(),
                chosen=chosen,
                chosen_forced=False,
                diagnostics=(),
                forward_ms=0.0,
                snapshot_ms=0.0,
                buffer=buffer,  # type: ignore[arg-type]
            )
        )

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
        if index is None:
            index = self._selected
        snapshot = self._snapshot
        if snapshot is None or index is None or not 0 <= index < len(snapshot.buffer):
            return ""
        token = snapshot.buffer[index]
        piece = token.piece if len(token.piece) <= 40 else token.piece[:39] + ELLIPSIS
        parts = [f"pos {token.position}", f"id {token.id}", repr(piece), token.origin, f"turn {token.turn}"]
        if token.special:
            parts.append("special")
        if index >= self._last_forward_start(snapshot):
            parts.append("last forward")
        layer = self._layer(snapshot)
        if layer is not None and index < layer.held_from:
            parts.append(f"evicted from layer {layer.index}")
        return " · ".join(parts)

    def visible_range(self) -> range:
        """Buffer indices on screen (for tests and for a later attention fetch)."""
        grid = self._grid
        first_row = self.scroll_offset.y
        height = max(1, self.scrollable_content_region.height)
        return range(min(grid.count, first_row * grid.cols), min(grid.count, (first_row + height) * grid.cols))

    # ------------------------------------------------------------------ layout

    def _compute_grid(self, width: int) -> _Grid:
        snapshot = self._snapshot
        count = 0 if snapshot is None else len(snapshot.buffer)
        largest = max(count, 0 if snapshot is None else snapshot.cursor)
        if count:
            largest = max(largest, snapshot.buffer[-1].position)  # type: ignore[union-attr]
        digits = max(4, len(str(largest)))
        gutter = digits + 1
        cell = max(self._cell_width, min(SPECIAL_CELL, self._special_width + 1))
        cols = max(1, (width - gutter) // cell)
        slots = count + 1 if count else 0
        rows = max(1, -(-slots // cols))
        return _Grid(width, digits, gutter, cell, cols, count, slots, rows)

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
        at_end = old.width == 0 or self.scroll_offset.y >= old.rows - old_height
        self._relayout()
        if self._selected is not None:
            self._scroll_to_index(self._selected)
        elif at_end:  # keep following the tail (also: the first layout after a show() before mount)
            self.scroll_end(animate=False, immediate=True, x_axis=False)

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

    def _render_row(self, row: int, grid: _Grid) -> Strip:
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
        selected = self._selected
        attention = self._attention
        attention_len = len(attention) if attention is not None else 0

        tokens = [buffer[i] for i in range(first, stop)]
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
            if index < evicted_before:
                names.append("token-buffer--evicted")
            if index == selected:
                names.append("token-buffer--selected")
            shade = 0
            if index < attention_len:
                weight = attention[index]  # type: ignore[index]
                shade = max(0, min(ATTENTION_LEVELS, round(weight * ATTENTION_LEVELS)))
            segments.append(Segment(fit(display_piece(token.piece), piece_width), self._style(tuple(names), shade)))
            segments.append(separator)
        if first <= grid.count < first + grid.cols:  # the ghost cell: where the next token goes
            pending = "" if snapshot.chosen is None else display_piece(snapshot.chosen.text)
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
            if snapshot is None:
                self.border_title = "cache"
            else:
                which = f" {snapshot.lineage}" if snapshot.cache_parent or snapshot.cache_unknown else ""
                title = f"cache{which} · {len(snapshot.buffer)} tokens · next pos {snapshot.cursor}"
                if snapshot.uncached:  # --cache none: the buffer is the context the step re-read, nothing is cached
                    title = f"context (no cache) · {len(snapshot.buffer)} tokens re-read · next pos {snapshot.cursor}"
                layer = self._layer(snapshot)
                if layer is not None:
                    title += f" · layer {layer.index} {layer.kind}"
                    if layer.held_from:
                        title += f" holds from {layer.held_from}"
                self.border_title = title

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

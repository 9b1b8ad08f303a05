"""The token buffer pane's helpers (token_buffer.py): its fixed grid, its styles, the buffer as one Rich Text for
the notebook, and one line about a token. Pure functions of a snapshot: no widget state."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from rich.cells import cell_len, set_cell_size
from rich.text import Text

from ...engine.records.snapshot import BufferToken, LayerInfo, StepSnapshot, TopToken
from ...engine.records.token_bytes import valid_utf8
from ...fmt import runs_text
from .token_pieces import bytes_note, char_length, piece_labels, token_label

EMPTY_TEXT = "cache empty — send a message"
CURSOR_GLYPH = "▌"
ELLIPSIS = "…"
SPECIAL_CELL = 33  # the grid widens up to this for a special token, so `<|start_header_id|>` is never cut


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
    labels = piece_labels(buffer, first, count, snapshot.token_bytes)
    for index in range(first, count):
        token = buffer[index]
        role, extra = ORIGIN_STYLES.get(token.origin, ("muted", ""))
        style = role_style(palette, role, f"{extra} {SPECIAL_STYLE}".strip() if token.special else extra)
        text.append(f"{token.position}", style=role_style(palette, "muted", "bold" if index >= last_forward else "dim"))
        text.append("\u00a0")  # the position stays with its piece when the line wraps
        text.append(labels[index - first], style=style)
        text.append(" ")
    pending = pending_label(snapshot)
    text.append(f"{CURSOR_GLYPH}{snapshot.cursor}\u00a0{pending}", style=role_style(palette, "accent", "bold"))
    return text


@dataclass(frozen=True, slots=True)
class Grid:
    width: int  # content width the grid was computed for
    digits: int  # gutter digits
    gutter: int  # gutter cells (digits + 1 space)
    cell: int  # cells per token incl. separator
    cols: int  # tokens per row
    count: int  # tokens in the buffer
    slots: int  # count + the ghost cursor cell (0 when there is nothing to show)
    rows: int


def compute_grid(snapshot: StepSnapshot | None, width: int, cell_width: int, special_width: int) -> Grid:
    """The grid for a content `width`: the gutter fits the largest position, the cells the widest special token
    seen (`special_width`, up to SPECIAL_CELL)."""
    count = 0 if snapshot is None else len(snapshot.buffer)
    largest = max(count, 0 if snapshot is None else snapshot.cursor)
    if count:
        largest = max(largest, snapshot.buffer[-1].position)  # type: ignore[union-attr]
    digits = max(4, len(str(largest)))
    gutter = digits + 1
    cell = max(cell_width, min(SPECIAL_CELL, special_width + 1))
    cols = max(1, (width - gutter) // cell)
    slots = count + 1 if count else 0
    rows = max(1, -(-slots // cols))
    return Grid(width, digits, gutter, cell, cols, count, slots, rows)


def pending_label(snapshot: StepSnapshot) -> str:
    """The chosen, not yet cached token, as the ghost cell shows it."""
    chosen = snapshot.chosen
    return "" if chosen is None else token_label(chosen.id, chosen.text, snapshot.token_bytes)


def describe_token(snapshot: StepSnapshot | None, index: int | None, layer: LayerInfo | None) -> str:
    """One line about a token: `pos 123 · id 4567 · '<|im_start|>' · template · turn 2 · special`; a piece of
    a character split across tokens adds its bytes and the character (`⟨bd a0⟩ of '你'`)."""
    if snapshot is None or index is None or not 0 <= index < len(snapshot.buffer):
        return ""
    token = snapshot.buffer[index]
    table = snapshot.token_bytes
    exact = bytes_note(token.id, table)
    piece = token.piece if exact is None else piece_labels(snapshot.buffer, index, index + 1, table)[0]
    piece = piece if len(piece) <= 40 else piece[:39] + ELLIPSIS
    parts = [f"pos {token.position}", f"id {token.id}", repr(piece)]
    if exact is not None:
        parts.append(exact + _character_of(snapshot.buffer, index, table))
    parts += [token.origin, f"turn {token.turn}"]
    if token.special:
        parts.append("special")
    if index >= len(snapshot.buffer) - len(snapshot.input_ids):
        parts.append("last forward")
    if layer is not None and not layer.holds(index):
        parts.append(f"evicted from layer {layer.index}")
    return " · ".join(parts)


def _character_of(buffer: Sequence[BufferToken], index: int, table) -> str:
    """` of '你'`: the character whose first bytes are on the tokens before this one (a continuation piece)."""
    data = table.get(buffer[index].id)
    if not data or data[0] & 0xC0 != 0x80:  # begins with a character of its own, not the rest of one
        return ""
    before = b"".join(table.get(t.id, t.piece.encode()) for t in (buffer[i] for i in range(max(0, index - 3), index)))
    lead = max((i for i, byte in enumerate(before) if byte & 0xC0 != 0x80), default=None)
    if lead is None:
        return ""
    after = b"".join(
        table.get(t.id, t.piece.encode()) for t in (buffer[i] for i in range(index + 1, min(len(buffer), index + 4)))
    )
    joined = before[lead:] + data + after  # the character may end on a later token too
    character = joined[: char_length(joined[0])]
    return f" of {character.decode()!r}" if valid_utf8(character) and character else ""


def buffer_title(snapshot: StepSnapshot | None, layer: LayerInfo | None) -> str:
    """The pane's title: what it holds, the next position, the layer whose evictions are greyed."""
    if snapshot is None:
        return "cache"
    which = f" {snapshot.lineage}" if snapshot.cache_parent or snapshot.cache_unknown else ""
    title = f"cache{which} · {len(snapshot.buffer)} tokens · next pos {snapshot.cursor}"
    if snapshot.uncached:  # --cache none: the buffer is the context the step re-read, nothing is cached
        title = f"context (no cache) · {len(snapshot.buffer)} tokens re-read · next pos {snapshot.cursor}"
    if layer is not None:
        title += f" · layer {layer.index} {layer.kind}"
        if layer.held is not None:  # a compressed cache: what this layer still holds
            title += f" holds {layer.filled} of {layer.seen}: {runs_text(layer.held)}"
        elif layer.held_from:
            title += f" holds from {layer.held_from}"
    return title


def buffer_snapshot(
    buffer: Sequence[BufferToken], cursor: int | None, last_forward_count: int, pending_text: str | None, layers
) -> StepSnapshot:
    """A snapshot holding only a buffer (callers without a StepSnapshot, e.g. a trace viewer)."""
    if cursor is None:
        cursor = buffer[-1].position + 1 if len(buffer) else 0
    chosen = None if pending_text is None else TopToken(id=-1, text=pending_text, logit=0.0, prob=0.0)
    return StepSnapshot(
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


BUFFER_CSS = """
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

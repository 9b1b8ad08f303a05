"""The attach screen's block detail: the selected block's hash, parent, chain, position, where it is held,
when it was stored, its tokens as text (special tokens as the cache pane draws them) and the notes that
point at it or its chain."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from ...engine.server.view import BlockInfo, TextsView
from ..shared.palette import Palette, role_style
from .server_tokens import tokens_text

EMPTY = "select a chain or a block in the tree (arrows, enter)"


def render_detail(info: BlockInfo | None, texts: TextsView, palette: Palette | None = None, gone: str = ""):
    """The detail as a Rich renderable (`gone`: what to say where the block is no longer held)."""
    if info is None:
        return Text(gone or EMPTY, style="italic")
    fields = Table.grid(padding=(0, 1))
    fields.add_column(style=role_style(palette, "muted"), no_wrap=True)
    fields.add_column()
    parent = info.parent or ("gone (an orphan: its parent was removed or came before kvtui)" if info.orphan else "-")
    # the token range first: a short pane (80x24) shows only the first rows
    fields.add_row(
        "chain",
        f"tokens {info.start}..{info.end} ({info.token_count}) · #{info.chain} · depth {info.depth}",
    )
    fields.add_row("hash", Text(info.key, style=role_style(palette, "info", "bold")))
    fields.add_row("parent", parent)
    medium = f"medium {info.medium} (as the server says)" if info.medium else "medium not said"
    fields.add_row(
        "held",
        f"group {info.group} · {medium} · {info.origin or 'events'}",
    )
    fields.add_row("stored", f"at batch {info.stored_batch} · {info.children} children")
    tokens = tokens_text(texts, info.tokens, palette)
    if info.token_count > len(info.tokens):
        tokens.append(f" … {info.token_count - len(info.tokens)} more tokens", style=role_style(palette, "muted"))
    parts: list = [fields, Text(""), tokens]
    if info.notes:
        parts.append(Text(""))
        for note in info.notes:
            line = Text()
            line.append(f"{note.severity} {note.code}", style=role_style(palette, note.severity, "bold"))
            line.append(f" (batch {note.step}): {note.message}")
            parts.append(line)
    return Group(*parts)


class BlockDetail(VerticalScroll):
    DEFAULT_CSS = """
    BlockDetail {
        border: round $foreground 25%;
        border-title-color: $text-muted;
        padding: 0 1;
        &:focus { border: round $accent; }
    }
    """

    def __init__(self, *, id: str | None = None):
        super().__init__(id=id)
        self.border_title = "block"
        self.info: BlockInfo | None = None

    def compose(self) -> ComposeResult:
        yield Static(Text(EMPTY, style="italic"), id="block-detail-body")

    def show(self, info: BlockInfo | None, texts: TextsView, palette: Palette | None = None, gone: str = "") -> None:
        self.info = info
        self.border_title = (
            "block" if info is None else f"block {info.key[:8]} · tokens {info.start}..{info.end} · chain #{info.chain}"
        )
        self.query_one("#block-detail-body", Static).update(render_detail(info, texts, palette, gone))

"""Token ids of a server's blocks as one printable line, special tokens styled as the cache pane draws them (the
prefix tree's labels and the block detail)."""

from __future__ import annotations

from collections.abc import Iterable

from rich.text import Text

from ...engine.server.view import TextsView
from ...fmt import token_text
from ..shared.palette import Palette, role_style

SPECIAL_STYLE = "bold reverse"  # as the cache pane draws a special token


def special_style(palette: Palette | None) -> str:
    return role_style(palette, "accent", SPECIAL_STYLE)


def tokens_text(texts: TextsView, ids: Iterable[int], palette: Palette | None = None, chars: int | None = None) -> Text:
    """Token ids as one printable line (newlines as ↵), special tokens in the cache pane's special style;
    cut with `…` past `chars` characters. `texts`: the frozen pieces a view was built with (or a TokenTexts)."""
    text = Text(no_wrap=chars is not None, overflow="ellipsis")
    special = texts.special
    style = special_style(palette)
    length = 0
    for token in ids:
        piece = token_text(texts.piece(int(token)))
        if chars is not None and length + len(piece) > chars:
            text.append(piece[: max(0, chars - length)], style=style if int(token) in special else "")
            text.append("…", style=role_style(palette, "muted"))
            break
        text.append(piece, style=style if int(token) in special else "")
        length += len(piece)
    return text

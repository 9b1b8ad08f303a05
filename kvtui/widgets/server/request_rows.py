"""The attach screen's requests: the newest prefills, one line each, with the tokens each found cached (its hits)
and those it stored new (its misses), the session its client gave and the miss cause a rule named.

A hit the server reported (the client sent `"vllm_xargs": {"kv_cache_report_mode": "full"}`) is shown as it
said; one inferred from the chain is marked `~`, and the title says what inference cannot see: a request whose
whole prompt hit stores nothing, so it has no row unless it asked for the report."""

from __future__ import annotations

import time

from rich.text import Text
from textual.widgets import Static

from ...engine.server.requests import RequestFacts
from ...engine.server.view import StatsView
from ..shared.palette import Palette, role_style

INFERRED_TITLE = "requests · ~ hits inferred from the chains (a whole-prompt hit stores nothing and is not listed)"
REPORTED_TITLE = "requests · hits as the server reported them (kv_cache_report_mode full); ~ inferred"
EMPTY = "no prefill announced yet (a prompt shorter than one block stores nothing)"


def hit_words(row: RequestFacts) -> str:
    if row.hit is None:
        return "hit ? (its chain began before kvtui attached)"
    return f"hit {row.hit}" if row.reported else f"hit ~{row.hit}"


def row_text(row: RequestFacts, several: bool, palette: Palette | None = None) -> Text:
    """One line, the facts first: hit, new, cause; then the session, the origin, the chain and the time."""
    text = Text()
    text.append(hit_words(row), style=role_style(palette, "info") if row.reported else "")
    text.append(f" · new {row.new}")
    if row.cause:
        text.append(f" · {row.cause}", style=role_style(palette, "warning"))
    if row.session:
        text.append(f" · session {row.session}", style="bold")
    if several:
        text.append(f" · {row.origin or 'events'}")
    text.append(f" · chain #{row.chain} · ", style=role_style(palette, "muted"))
    text.append(time.strftime("%H:%M:%S", time.localtime(row.ts)), style=role_style(palette, "muted"))
    return text


def render_rows(view: StatsView, palette: Palette | None = None) -> tuple[str, Text]:
    """The pane's title and its lines (newest first)."""
    reported = any(stats.reports for _, stats in view.origins)
    title = REPORTED_TITLE if reported else INFERRED_TITLE
    if not view.requests:
        return title, Text(EMPTY, style="italic")
    several = len(view.origins) > 1
    body = Text("\n").join(row_text(row, several, palette) for row in view.requests)
    return title, body


class RequestRows(Static):
    DEFAULT_CSS = """
    RequestRows {
        height: auto;
        max-height: 8;
        border: round $foreground 25%;
        border-title-color: $text-muted;
        padding: 0 1;
        overflow-y: hidden;
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }
    """

    def __init__(self, *, id: str | None = None):
        super().__init__(EMPTY, id=id)
        self.border_title = INFERRED_TITLE

    def show(self, view: StatsView, palette: Palette | None = None) -> None:
        title, body = render_rows(view, palette)
        self.border_title = title
        self.update(body)

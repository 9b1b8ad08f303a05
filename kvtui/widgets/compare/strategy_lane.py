"""One strategy of `kvtui compare`: its numbers and the current turn's reply, as they arrive.

`render_lane(lane, palette)` is pure (a Rich Text from a kvtui.compare.Lane); `StrategyLane` is a Static around it.
"""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from kvtui.fmt import size as format_bytes
from kvtui.fmt import token_text
from kvtui.widgets.shared.palette import Palette, role_style


def render_lane(lane, palette: Palette | None = None, reply_tail: int = 400) -> Text:
    text = Text(overflow="fold")
    muted = role_style(palette, "muted")
    if lane.error:
        text.append(f"error: {lane.error}", style=role_style(palette, "error", "bold"))
        return text
    if not lane.points:
        text.append("loading…" if not lane.description else "ready", style=muted)
        return text
    rate = lane.tokens_per_s
    last = lane.decode[-1] if lane.decode else None
    text.append(f"{rate:.1f}" if rate else "-", style="bold")
    text.append(" tok/s", style=muted)
    if last is not None:
        text.append(" · now ", style=muted)
        text.append(f"{last.ms:.1f} ms", style="bold")
        text.append(f"/token @ {last.context}", style=muted)
    text.append("\ncache ", style=muted)
    if lane.strategy == "none":
        text.append("none", style=role_style(palette, "warning", "bold"))
        text.append(f" · re-reads {lane.context} tokens a step", style=muted)
    else:
        text.append(format_bytes(lane.cache_bytes), style="bold")
        text.append(f" · holds {lane.cache_length}", style=muted)
    if lane.compile_ms:
        text.append("\ncompile ", style=muted)
        text.append(f"{lane.compile_ms / 1000:.1f} s", style=role_style(palette, "accent", "bold"))
        text.append(f" · {lane.recompiles} recompiles", style=muted)
    text.append("\n")
    reply = lane.reply_text
    text.append(token_text(reply[-reply_tail:]) if reply else "…", style=role_style(palette, "success"))
    return text


class StrategyLane(Static):
    DEFAULT_CSS = """
    StrategyLane { width: 1fr; height: 1fr; border: round $foreground 25%; border-title-color: $text-accent;
               border-title-style: bold; padding: 0 1; }
    """

    def __init__(self, strategy: str, **kwargs) -> None:
        super().__init__("", **kwargs)
        self.border_title = strategy

    def show(self, lane, palette: Palette | None = None) -> None:
        self.update(render_lane(lane, palette))

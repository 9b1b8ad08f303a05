"""The cursor pane: where the session writes next, what the cache says it holds, and whether they agree.

`render_cursor(snapshot)` is the whole pane as a rich `Text` (pure, testable without an App);
`CursorPane` is a thin `LiveText` (a Static) around it. Everything here is O(layers): the buffer is never read.
"""

from __future__ import annotations

from collections.abc import Mapping

from rich.text import Text

from kvtui.engine.records.snapshot import BufferToken, StepSnapshot
from kvtui.widgets.shared.live_text import LiveText
from kvtui.widgets.shared.palette import Palette, ThemedPane, role_style
from kvtui.widgets.step.layers_pane import shape_summary
from kvtui.widgets.step.token_pieces import token_label

# ---------------------------------------------------------------------------------------------
# pure rendering
# ---------------------------------------------------------------------------------------------


def format_positions(positions: tuple[int, ...]) -> str:
    """'37..52 (16 tokens)', '53', or '-' -- O(1): only the ends are read."""
    n = len(positions)
    if n == 0:
        return "-"
    if n == 1:
        return str(positions[0])
    first, last = positions[0], positions[-1]
    gaps = "" if last - first + 1 == n else ", not contiguous"
    return f"{first}..{last} ({n} tokens{gaps})"


def kind_summary(snapshot: StepSnapshot) -> str | None:
    """'full 120 · sliding 7 held of 120 seen (window 8)' when layer kinds hold different counts.

    None when every layer holds the same number of tokens (nothing to explain).
    """
    layers = snapshot.layers
    fed = fed_count(snapshot)
    if fed is not None:  # compressed: slots held against tokens fed
        filled = sorted({layer.filled for layer in layers})
        held = str(filled[0]) if len(filled) == 1 else f"{filled[0]}-{filled[-1]}"
        return f"{held} slots of {fed} fed (compressed)"
    if not layers or len({layer.filled for layer in layers}) <= 1:
        return None
    kinds: dict[str, list] = {}
    for layer in layers:
        kinds.setdefault(layer.kind, []).append(layer)
    parts = []
    for kind, group in kinds.items():
        filled = sorted({layer.filled for layer in group})
        seen = max(layer.seen for layer in group)
        windows = sorted({layer.window for layer in group if layer.window is not None})
        held = str(filled[0]) if len(filled) == 1 else f"{filled[0]}-{filled[-1]}"
        text = f"{kind} {held}" if filled == [seen] else f"{kind} {held} held of {seen} seen"
        if windows:
            text += f" (window {'/'.join(map(str, windows))})"
        parts.append(text)
    return " · ".join(parts)


def capacity_bar(used: int, capacity: int, width: int = 20) -> str:
    """A text bar of `width` cells, eighths included."""
    if capacity <= 0:
        return "░" * width
    fraction = min(max(used / capacity, 0.0), 1.0)
    eighths = round(fraction * width * 8)
    full, part = divmod(eighths, 8)
    bar = "█" * full + ("▏▎▍▌▋▊▉"[part - 1] if part else "")
    return bar + "░" * (width - len(bar))


def fed_count(snapshot: StepSnapshot) -> int | None:
    """A compressed cache (a press evicted positions): the tokens fed into it, which its slots no longer count."""
    held = [layer.seen for layer in snapshot.layers if layer.held is not None]
    return max(held) if held else None


def has_alarm(snapshot: StepSnapshot | None) -> bool:
    if snapshot is None or snapshot.uncached:
        return False
    # a compressed cache's next position continues what its kept keys encode: the tokens fed (kept as written)
    # or its slots (re-rotated); the engine's position rule tells which, here either is not the cursor's alarm
    return snapshot.cursor not in (snapshot.cache_seq_length, fed_count(snapshot))


def describe_token(token: BufferToken, token_bytes: Mapping[int, bytes] | None = None) -> str:
    """The whole piece, id, position and origin: "pos 0 · id 1 · '<|im_start|>' · template · special"; a piece
    that is no character on its own is its bytes: "'⟨e4 bd⟩'" (`token_bytes`: the snapshot's)."""
    label = token_label(token.id, token.piece, token_bytes or {})
    parts = [f"pos {token.position}", f"id {token.id}", f"'{label}'", token.origin]
    if token.special:
        parts.append("special")
    return " · ".join(parts)


def render_cursor(
    snapshot: StepSnapshot | None,
    palette: Palette | None = None,
    selected: BufferToken | None = None,
    request: Text | None = None,
) -> Text:
    """The cursor pane's content: step, cursor vs cache length, every layer's K/V shape (grouped), the
    token selected in the buffer in full; `request`: the shown request's line (a packed forward, requests_pane.
    describe_request). O(layers): the buffer is never read."""
    text = Text(no_wrap=False, overflow="fold")
    if snapshot is None:
        text.append("no step yet", style=role_style(palette, "muted"))
        return text

    phase_role = {"prefill": "primary", "decode": "success", "rewind": "warning"}.get(snapshot.phase, "accent")
    text.append("step ", style=role_style(palette, "muted"))
    text.append(str(snapshot.step), style="bold")
    text.append(" · ")
    text.append(snapshot.phase, style=role_style(palette, phase_role, "bold"))
    text.append(" · turn ", style=role_style(palette, "muted"))
    text.append(str(snapshot.turn))
    if snapshot.turn_done:
        text.append(" · turn done", style=role_style(palette, "muted"))
    text.append("\n")
    if request is not None:
        text.append_text(request)
        text.append("\n")

    alarm = has_alarm(snapshot)
    text.append("cursor ", style=role_style(palette, "muted"))
    text.append(str(snapshot.cursor), style="bold")
    if snapshot.uncached:  # --cache none: nothing is cached; the step re-read the whole context
        text.append(" · no cache: ", style=role_style(palette, "muted"))
        text.append(f"full forward over {len(snapshot.buffer)} tokens", style=role_style(palette, "warning", "bold"))
    else:
        text.append(" · cache length ", style=role_style(palette, "muted"))
        text.append(str(snapshot.cache_seq_length), style=role_style(palette, "error", "bold") if alarm else "bold")
    text.append("\n")

    shapes = shape_summary(snapshot)
    if shapes:
        text.append("layers ", style=role_style(palette, "muted"))
        text.append(shapes)
        text.append("\n")

    kinds = kind_summary(snapshot)
    if kinds:
        text.append("held ", style=role_style(palette, "muted"))
        text.append(kinds)
        text.append("\n")

    if snapshot.capacity is not None:
        used, capacity = snapshot.cache_seq_length, snapshot.capacity
        fraction = used / capacity if capacity > 0 else 1.0
        role = "success" if fraction < 0.75 else "warning" if fraction < 0.95 else "error"
        text.append("capacity ", style=role_style(palette, "muted"))
        text.append(capacity_bar(used, capacity), style=role_style(palette, role))
        text.append(f" {used}/{capacity}")
        text.append(f" ({fraction:.0%})", style=role_style(palette, "muted"))
        text.append("\n")

    if selected is not None:
        text.append("selected ", style=role_style(palette, "muted"))
        text.append(describe_token(selected, snapshot.token_bytes), style="bold" if selected.special else "")
        text.append("\n")

    text.append("fed ", style=role_style(palette, "muted"))
    text.append(format_positions(snapshot.positions))
    text.append(f" · forward {snapshot.forward_ms:.1f} ms", style=role_style(palette, "muted"))

    if alarm:
        text.append("\n")
        text.append(
            f"ALARM cursor {snapshot.cursor} ≠ cache length {snapshot.cache_seq_length}"
            + (f" or {fed_count(snapshot)} fed" if fed_count(snapshot) is not None else ""),
            style=role_style(palette, "error", "bold reverse"),
        )
    return text


# ---------------------------------------------------------------------------------------------
# widget
# ---------------------------------------------------------------------------------------------


class CursorPane(ThemedPane, LiveText):
    """Cursor, cache length, per-kind fill, static capacity, fed positions and the cursor alarm."""

    DEFAULT_CSS = """
    CursorPane {
        height: auto;
        padding: 0 1;
        border: round $primary;
        border-title-color: $primary;
        color: $foreground;
    }
    CursorPane.-alarm {
        border: round $error;
        border-title-color: $error;
    }
    """

    def __init__(self, *, name: str | None = None, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(render_cursor(None), name=name, id=id, classes=classes)
        self.border_title = "cursor"
        self._snapshot: StepSnapshot | None = None
        self._selected: BufferToken | None = None
        self._request: Text | None = None

    def on_mount(self) -> None:
        self.follow_theme()
        self._render_snapshot()

    def repaint_theme(self) -> None:
        self._render_snapshot()

    @property
    def snapshot(self) -> StepSnapshot | None:
        return self._snapshot

    @property
    def alarm(self) -> bool:
        """True while the shown snapshot's cursor disagrees with the cache length."""
        return has_alarm(self._snapshot)

    def show(self, snapshot: StepSnapshot | None) -> None:
        self._snapshot = snapshot
        self._render_snapshot()

    def show_token(self, token: BufferToken | None) -> None:
        """The token selected in the buffer pane (None: no token line)."""
        self._selected = token
        self._render_snapshot()

    def show_request(self, line: Text | None) -> None:
        """The shown request's line (a packed forward), None: no request line."""
        self._request = line
        self._render_snapshot()

    def _render_snapshot(self) -> None:
        self.show_text(render_cursor(self._snapshot, self._palette, self._selected, self._request))
        self.set_class(self.alarm, "-alarm")

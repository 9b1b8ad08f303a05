"""Where the step looked (--attention): a header with the selection and its largest weights, and one row per
region of the step's partition of the positions (sink, pad, special, the last W tokens, system, unknown, the
earlier turns together, this turn: each position in one, so the rows add to 100 %), with one cell per layer,
shaded by the share of the newest query's attention that layer put there; two rows to a line where they are
more than four. A step whose capture is on but carries no attention shows the engine's one line of why.

`attention_view(snapshot, layer, head)` and `render_strip(...)` are pure (testable without an App); the app
shades the token buffer with `shading(...)`. Layer None: the mean over every layer; head None: the head mean.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text

from kvtui.engine.records.snapshot import StepSnapshot
from kvtui.widgets.shared.live_text import LiveText
from kvtui.widgets.shared.palette import role_style
from kvtui.widgets.step.token_pieces import piece_labels

BLOCKS = " ▁▂▃▄▅▆▇█"
LABEL = 11
LINES = 4  # region lines at most: more rows go two to a line
Entries = Sequence[tuple[int, float]]


def attention_view(snapshot: StepSnapshot, layer: int | None, head: int | None) -> tuple[Entries, str]:
    """(the selected row's (position, weight) pairs, what it is): all layers, one layer's head mean, one head.
    A head of a layer whose heads this step did not keep falls back to that layer's head mean (said)."""
    attention = snapshot.attention or ()
    detail = snapshot.attention_detail
    if layer is None or not 0 <= layer < len(attention) or attention[layer] is None:
        entries = detail.all_layers if detail is not None else ()
        return entries, f"all {sum(e is not None for e in attention)} layers"
    name = f"layer {layer}"
    if head is None:
        return attention[layer], f"{name} · head mean"
    if detail is None or detail.layer != layer or not 0 <= head < len(detail.heads):
        return attention[layer], f"{name} · head mean (its heads come with the next step)"
    group_size = max(1, len(detail.heads) // max(1, len(detail.groups)))
    return detail.heads[head], f"{name} · head {head}/{len(detail.heads)} · kv {head // group_size}"


def shading(snapshot: StepSnapshot, layer: int | None, head: int | None) -> list[float]:
    """One weight in 0..1 per buffer position (the largest is 1), for the token buffer's shading."""
    entries, _ = attention_view(snapshot, layer, head)
    total = len(snapshot.buffer)
    row = [0.0] * total
    peak = max((w for _, w in entries), default=0.0) or 1.0
    for position, weight in entries:
        if 0 <= position < total:
            row[position] = weight / peak
    return row


def render_strip(snapshot: StepSnapshot, layer: int | None, head: int | None, width: int, palette=None) -> Text:
    """The header and the per-layer region lines, each fitting `width` cells (layers bucketed when many)."""
    text = Text(no_wrap=True, overflow="ellipsis")
    entries, what = attention_view(snapshot, layer, head)
    text.append("attn ", style=role_style(palette, "accent", "bold"))
    text.append(what, style=role_style(palette, "muted"))
    buffer = snapshot.buffer
    for position, weight in entries[:4]:
        inside = 0 <= position < len(buffer)  # a piece of a split character as the buffer shows it (token_pieces.py)
        piece = piece_labels(buffer, position, position + 1, snapshot.token_bytes)[0] if inside else "?"
        text.append(f" · #{position} {piece} {weight:.0%}")
    text.truncate(width, overflow="ellipsis")  # one line: the strip keeps its height at 80 columns
    detail = snapshot.attention_detail
    if detail is None:
        return text
    shares = detail.shares
    layers = [i for i, row in enumerate(shares) if row is not None]
    if not layers:
        return text
    rows = region_rows(detail.regions, shares)
    across = 2 if len(rows) > LINES else 1
    column = (width - 2 * (across - 1)) // across  # two columns: 2 cells between them
    cells = max(1, column - LABEL - 5)
    per = max(1, -(-len(layers) // cells))  # layers per cell
    buckets = [layers[i : i + per] for i in range(0, len(layers), per)]
    chosen = [layer] if layer is not None and shares[layer] is not None else layers
    for start in range(0, len(rows), across):
        text.append("\n")
        for i, (name, values) in enumerate(rows[start : start + across]):
            text.append("  " if i else "")
            text.append(f"{name[: LABEL - 1]:<{LABEL}}", style=role_style(palette, "muted"))
            for bucket in buckets:
                share = max(values[j] for j in bucket)
                mark = "reverse" if layer is not None and layer in bucket else ""
                text.append(BLOCKS[max(0, min(len(BLOCKS) - 1, round(share * (len(BLOCKS) - 1))))], style=mark)
            mean = sum(values[j] for j in chosen) / len(chosen)
            text.append(f" {mean:4.0%}")
            text.append(" " * max(0, column - LABEL - len(buckets) - 5) if i + 1 < across else "")
    return text


def region_rows(regions: Sequence[str], shares) -> list[tuple[str, list[float]]]:
    """(name, per layer its share) of each row the strip shows: the step's regions in their order, the turns
    before this one added up into one row (`turn 1`, or `turns 1–3`): still a partition, still 100 % in all."""
    count = len(shares)
    rows: list[tuple[str, list[float]]] = []
    earlier: list[int] = []
    for column, name in enumerate(regions):
        values = [row[column] if row is not None else 0.0 for row in shares]
        if name.startswith("turn "):
            earlier.append(column)
            continue
        rows.append((name, values))
    if earlier:
        numbers = [regions[c].split()[1] for c in earlier]
        name = f"turn {numbers[0]}" if len(numbers) == 1 else f"turns {numbers[0]}–{numbers[-1]}"
        values = [sum(shares[i][c] for c in earlier) if shares[i] is not None else 0.0 for i in range(count)]
        at = next((i for i, (n, _) in enumerate(rows) if n == "this turn"), len(rows))
        rows.insert(at, (name, values))
    return rows


class AttentionStrip(LiveText):
    """Under the token buffer while the steps carry attention (hidden otherwise)."""

    DEFAULT_CSS = """
    AttentionStrip { height: auto; max-height: 5; padding: 0 1; background: $panel; display: none; }
    """

    _shown: tuple[StepSnapshot, int | None, int | None] | None = None

    def show(self, snapshot: StepSnapshot | None, layer: int | None, head: int | None) -> None:
        shown = snapshot is not None and (snapshot.attention is not None or bool(snapshot.attention_off))
        self.display = shown
        if not shown:
            self._shown = None
            return
        assert snapshot is not None
        self._shown = (snapshot, layer, head)
        if snapshot.attention is None:  # capture on, none this step: the engine's reason, where the strip would be
            self.show_text(Text(snapshot.attention_off or "", style=role_style(None, "muted")))
        else:
            self.show_text(render_strip(snapshot, layer, head, max(20, self.size.width - 2)))

    def on_resize(self) -> None:
        """Drawn again to its width (it was drawn before its first layout, hidden, at 20 cells)."""
        if self._shown is not None and self.display:
            self.show(*self._shown)


HEAT = " ░▒▓█"


def render_heatmap(snapshot: StepSnapshot, width: int = 120, palette=None) -> Text:
    """The notebook's heat map: one line per layer, one cell per buffer position (bucketed to fit `width`, the
    bucket's largest weight), shaded by the layer's weight over its own largest; a layer with no attention
    is a line of dots."""
    text = Text(no_wrap=True)
    attention = snapshot.attention or ()
    total = len(snapshot.buffer)
    if not attention or not total:
        return text
    label = len(str(len(attention) - 1)) + 2
    cells = max(1, min(total, width - label - 1))
    per = -(-total // cells)  # positions per cell
    text.append(" " * label + f"positions 0–{total - 1}" + (f", {per} per cell" if per > 1 else ""), style="dim")
    for layer, entries in enumerate(attention):
        text.append("\n")
        text.append(f"L{layer:<{label - 1}}", style=role_style(palette, "muted"))
        if entries is None:
            text.append("·" * -(-total // per), style="dim")
            continue
        row = [0.0] * -(-total // per)
        for position, weight in entries:
            if 0 <= position < total:
                row[position // per] = max(row[position // per], weight)
        peak = max(row) or 1.0
        text.append("".join(HEAT[min(len(HEAT) - 1, round(w / peak * (len(HEAT) - 1)))] for w in row))
    return text

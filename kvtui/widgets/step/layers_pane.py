"""The layers pane: one DataTable row per cache layer, a totals line below; a paged cache (continuous
batching) its block groups instead (`render_paged`).

`layer_cells(layer)` / `layer_rows(snapshot)` / `render_totals(...)` are pure (testable without an
App); `LayersPane` updates the table's cells in place when the layer count is unchanged, so a new
step repaints no more than the cells that changed and the cursor never jumps (`table_rows.update_rows`).
O(layers) per step.
"""

from __future__ import annotations

from typing import NamedTuple

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import DataTable

from kvtui.engine.records.snapshot import LayerInfo, PagedGroupView, StepSnapshot
from kvtui.fmt import runs_text
from kvtui.fmt import size as format_bytes
from kvtui.widgets.shared.live_text import LiveText
from kvtui.widgets.shared.palette import Palette, ThemedPane, role_style
from kvtui.widgets.shared.table_rows import fit_columns, update_rows

# (key, label) of the table's columns, in order: the numbers people compare first, the long shapes and
# the per-layer dtype/device (also in the totals line when every layer shares them) last, so a narrow
# pane cuts those, never the bytes.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("index", "#"),
    ("kind", "kind"),
    ("bytes", "bytes"),
    ("filled", "filled/cap"),
    ("window", "window"),
    ("k_shape", "K shape"),
    ("v_shape", "V shape"),
    ("dtype", "dtype"),
    ("device", "device"),
)

# the compact column a narrow pane shows instead of the two shapes (index len(COLUMNS) in a display row)
COMPACT_COLUMN = ("kv", "K·V")
# what a narrow pane keeps, most important first (indices into COLUMNS + COMPACT_COLUMN)
PRIORITY = (0, 9, 1, 3, 2, 4, 7, 8)
# the labels a narrow pane writes shorter: "filled/cap" is wider than its values ("43/∞") and cost the column
NARROW_LABELS = {"filled": "fill"}

_KIND_ROLES = {"full": "primary", "sliding": "accent", "static": "success", "static-sliding": "warning"}


def format_shape(shape: tuple[int, ...]) -> str:
    return "×".join(str(d) for d in shape) if shape else "-"


def format_filled(filled: int, capacity: int | None) -> str:
    return f"{filled}/{'∞' if capacity is None else capacity}"


def format_window(layer: LayerInfo) -> str:
    if layer.held is not None:  # a compressed cache: which positions it still holds
        heads = f" ({len(layer.held_heads)} heads differ)" if layer.held_heads else ""
        return f"holds {runs_text(layer.held)}{heads}"
    if layer.window is None:
        return "-"
    return f"{layer.window} from {layer.held_from}" if layer.held_from > 0 else str(layer.window)


def format_kind(layer: LayerInfo) -> str:
    """'full', 'ssm', or for a quantized layer 'quantized 4b · 12 fp' (bits, tokens still in full precision)."""
    if layer.quant_bits is not None:
        return f"quantized {layer.quant_bits}b · {layer.residual} fp"
    return layer.kind + (" (offloaded)" if layer.offloaded else "")


def state_cells(layer: LayerInfo) -> tuple[str, str]:
    """K/V columns: K/V shapes; a layer without K/V shows its conv / recurrent state shapes there instead."""
    if layer.k_shape or not layer.states:
        return format_shape(layer.k_shape), format_shape(layer.v_shape)
    shown = [f"{name} {format_shape(shape)}" for name, shape in layer.states]
    return shown[0], ", ".join(shown[1:]) or "-"


def compact_shape(layer: LayerInfo) -> str:
    """K and V in one short cell: 'K=V 3×125×64' (batch 1 left out, K and V alike), 'K 1×12×16 V 1×12×8',
    'K=V b2 2×37×16' (batch 2); a layer without K/V its states ('conv 128×4, recurrent 4×16×16')."""
    if not layer.k_shape:
        k_text, v_text = state_cells(layer)
        return k_text if v_text == "-" else f"{k_text}, {v_text}"
    k, v = tuple(layer.k_shape), tuple(layer.v_shape)
    batch = ""
    if len(k) == 4 and len(v) == 4 and k[0] == v[0]:
        batch = "" if k[0] == 1 else f"b{k[0]} "
        k, v = k[1:], v[1:]
    if k == v:
        return f"K=V {batch}{format_shape(k)}"
    return f"K {batch}{format_shape(k)} V {format_shape(v)}"


def shape_summary(snapshot: StepSnapshot | None) -> str:
    """Every layer's K/V shape in one line, layers of one kind and shape counted together:
    '30 full K=V 3×125×64', '3 sliding K=V 2×7×16 · 1 full K=V 2×12×16'. O(layers)."""
    if snapshot is None or not snapshot.layers:
        return ""
    groups: dict[tuple[str, str], int] = {}
    for layer in snapshot.layers:
        key = (format_kind(layer), compact_shape(layer))
        groups[key] = groups.get(key, 0) + 1
    return " · ".join(f"{n} {kind} {shape}" for (kind, shape), n in groups.items())


def layer_cells(layer: LayerInfo, palette: Palette | None = None) -> tuple[Text, ...]:
    """The cells of one layer's row, in COLUMNS order (Text, never markup: pieces stay literal)."""
    full = layer.capacity is not None and layer.filled >= layer.capacity
    evicted = layer.held_from > 0 or layer.held is not None
    k_text, v_text = state_cells(layer)
    return (
        Text(str(layer.index), justify="right"),
        Text(format_kind(layer), style=role_style(palette, _KIND_ROLES.get(layer.kind, "accent"))),
        Text(format_bytes(layer.bytes), justify="right"),
        Text(
            format_filled(layer.filled, layer.capacity) if layer.held is None else f"{layer.filled} of {layer.seen}",
            justify="right",
            style=role_style(palette, "warning") if full else role_style(palette, "accent") if layer.held else "",
        ),
        Text(format_window(layer), style=role_style(palette, "accent") if evicted else ""),
        Text(k_text),
        Text(v_text),
        Text(layer.dtype),
        Text(layer.device),
    )


class LayerRow(NamedTuple):
    key: str
    index: int
    cells: tuple[Text, ...]


def layer_rows(snapshot: StepSnapshot | None, palette: Palette | None = None) -> list[LayerRow]:
    if snapshot is None:
        return []
    return [LayerRow(f"layer-{layer.index}", layer.index, layer_cells(layer, palette)) for layer in snapshot.layers]


def head_summary(query_heads: int | None, kv_heads: int | None) -> str:
    """'KV heads 2 vs query heads 4 (GQA ×2)'."""
    if kv_heads is None:
        return "" if query_heads is None else f"query heads {query_heads}"
    if query_heads is None:
        return f"KV heads {kv_heads}"
    text = f"KV heads {kv_heads} vs query heads {query_heads}"
    if kv_heads == query_heads:
        return text + " (MHA)"
    if kv_heads == 1:
        return text + " (MQA)"
    if kv_heads and query_heads % kv_heads == 0:
        return text + f" (GQA ×{query_heads // kv_heads})"
    return text


def render_totals(
    snapshot: StepSnapshot | None,
    query_heads: int | None = None,
    kv_heads: int | None = None,
    palette: Palette | None = None,
) -> Text:
    """'total 1.5 MiB · 4 layers (2 full, 2 sliding) · KV heads 2 vs query heads 4 (GQA ×2)'."""
    text = Text()
    if snapshot is not None and snapshot.uncached:
        text.append("no cache (--cache none): ", style=role_style(palette, "warning", "bold"))
        text.append(
            f"no layers; every step is a full forward over all {len(snapshot.buffer)} tokens",
            style=role_style(palette, "muted"),
        )
        return text
    if snapshot is None or not snapshot.layers:
        text.append("no layers yet", style=role_style(palette, "muted"))
        return text
    layers = snapshot.layers
    if kv_heads is None:
        kv_heads = snapshot.kv_heads  # layer 0's [batch, kv_heads, slots, head_dim]; every rank's shards together
    kinds: dict[str, int] = {}
    for layer in layers:
        kinds[layer.kind] = kinds.get(layer.kind, 0) + 1
    text.append("total ", style=role_style(palette, "muted"))
    text.append(format_bytes(snapshot.cache_bytes), style="bold")
    text.append(f" · {len(layers)} layers (", style=role_style(palette, "muted"))
    text.append(", ".join(f"{n} {kind}" for kind, n in kinds.items()), style=role_style(palette, "muted"))
    text.append(")", style=role_style(palette, "muted"))
    kinds_of = {(layer.dtype, layer.device) for layer in layers if layer.dtype != "-"}
    if len(kinds_of) == 1:
        dtype, device = next(iter(kinds_of))
        text.append(f" · {dtype} on {device}", style=role_style(palette, "muted"))
    heads = head_summary(query_heads, kv_heads)
    if heads:
        text.append(" · ")
        text.append(heads)
    if any(layer.held is not None for layer in layers):
        text.append("\n")
        text.append_text(kept_strip(layers, palette))
    if snapshot.tensor_parallel and len(layers[0].k_shape) == 4:  # this rank's layers are one shard of them
        ranks, each = snapshot.tensor_parallel, layers[0].k_shape[1]
        text.append(
            f" in all: {ranks} ranks × {each} each (this rank's layers below)", style=role_style(palette, "muted")
        )
    return text


_LEVELS = "▁▂▃▄▅▆▇█"


def kept_strip(layers: tuple[LayerInfo, ...], palette: Palette | None = None) -> Text:
    """A compressed cache: one cell per layer, its height the fraction of fed tokens the layer still holds (the mean
    of its KV heads' where they differ: a per-head mask keeps the slots), then the range:
    'kept ▄▄▃▅ 41–52% of 98 fed · heads differ in 2 layers'."""
    fractions = [layer.kept_fraction for layer in layers]
    text = Text("kept ", style=role_style(palette, "muted"))
    text.append("".join(_LEVELS[min(7, int(f * 8))] for f in fractions), style=role_style(palette, "accent"))
    low, high = min(fractions), max(fractions)
    span = f"{low:.0%}" if round(low, 2) == round(high, 2) else f"{low:.0%}–{high:.0%}"
    text.append(f" {span} of {max(layer.seen for layer in layers)} fed", style=role_style(palette, "muted"))
    differ = sum(1 for layer in layers if layer.held_heads)
    if differ:
        text.append(f" · heads differ in {differ} layers", style=role_style(palette, "muted"))
    return text


PAGED_BAR_WIDTH = 16


def paged_bar(group: PagedGroupView, palette: Palette | None = None, width: int = PAGED_BAR_WIDTH) -> Text:
    """The group's blocks as a bar: shared (used by several requests), used by one, cached (kept for reuse),
    free; each segment at least one cell when it is not empty."""
    total = max(group.total, 1)
    segments = [
        (group.shared, "▓", role_style(palette, "accent")),
        (max(group.used - group.shared, 0), "█", role_style(palette, "primary")),
        (group.cached, "▒", role_style(palette, "muted")),
    ]
    text = Text()
    left = width
    for count, char, style in segments:
        cells = min(left, max(1 if count else 0, round(count / total * width)))
        text.append(char * cells, style=style)
        left -= cells
    text.append("░" * left, style=role_style(palette, "muted"))
    return text


def render_paged(paged: tuple[PagedGroupView, ...], palette: Palette | None = None) -> Text:
    """A paged cache, one line per group: 'full ▓▓███▒░░░ 12 used (3 shared) · 2 cached · 50 free of 64 ×
    16 tok · 24 layers' (blocks of 16 tokens). O(groups)."""
    muted = role_style(palette, "muted")
    text = Text()
    name_width = max((len(group.name) for group in paged), default=0)
    for i, group in enumerate(paged):
        if i:
            text.append("\n")
        text.append(group.name.ljust(name_width), style=role_style(palette, _KIND_ROLES.get(group.name, "accent")))
        text.append(" ")
        text.append_text(paged_bar(group, palette))
        full = group.free == 0
        text.append(" ")
        text.append(str(group.used), style=role_style(palette, "error", "bold") if full else "bold")
        text.append(" used", style=muted)
        if group.shared:
            text.append(" (", style=muted)
            text.append(f"{group.shared} shared", style=role_style(palette, "accent"))
            text.append(")", style=muted)
        text.append(f" · {group.cached} cached · ", style=muted)
        text.append(str(group.free), style=role_style(palette, "warning", "bold") if full else "")
        text.append(f" free of {group.total} × {group.block_tokens} tok · {group.layers} layers", style=muted)
    if not paged:
        text.append("paged cache: no groups", style=muted)
    return text


class LayersPane(ThemedPane, Vertical):
    """Per-layer K/V shapes, dtype, device, bytes, fill and window; posts LayerSelected."""

    DEFAULT_CSS = """
    LayersPane {
        height: 1fr;
        border: round $primary;
        border-title-color: $primary;
    }
    LayersPane:focus-within {
        border: round $accent;
    }
    LayersPane > DataTable {
        height: 1fr;
    }
    LayersPane > #layers-totals {
        height: auto;
        padding: 0 1;
        color: $text-muted;
    }
    """

    class LayerSelected(Message):
        """The user moved the row cursor to (or pressed enter on) a layer; `initial`: the cursor's first row when
        the table first filled, which no one chose."""

        def __init__(self, index: int, initial: bool = False) -> None:
            super().__init__()
            self.index = index
            self.initial = initial

    def __init__(self, *, name: str | None = None, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.border_title = "layers"
        self._snapshot: StepSnapshot | None = None
        self._rows: list[LayerRow] = []
        self._shown_columns: list[int] = list(range(len(COLUMNS)))  # what the table has, by index
        self._query_heads: int | None = None
        self._kv_heads: int | None = None
        self._selected: int | None = None
        self._ready = False

    def compose(self) -> ComposeResult:
        table: DataTable = DataTable(id="layers-table", cursor_type="row", zebra_stripes=True)
        for key, label in COLUMNS:
            table.add_column(label, key=key)
        yield table
        yield LiveText(render_totals(None), id="layers-totals")

    def on_mount(self) -> None:
        self._ready = True  # is_mounted only turns True after on_mount returns
        self.follow_theme()
        if self._snapshot is not None:
            self._refresh_table(force=True)

    def repaint_theme(self) -> None:
        self._refresh_table(force=True)

    # -- public API -----------------------------------------------------------------------------

    @property
    def table(self) -> DataTable:
        return self.query_one("#layers-table", DataTable)

    @property
    def selected_layer(self) -> int | None:
        """Index (LayerInfo.index) of the layer under the row cursor, None with no layers."""
        return self._selected

    def set_model_info(self, query_heads: int | None, kv_heads: int | None) -> None:
        self._query_heads, self._kv_heads = query_heads, kv_heads
        if self._ready:
            self._update_totals()

    def show(self, snapshot: StepSnapshot | None) -> None:
        self._snapshot = snapshot
        if self._ready:
            self._refresh_table()

    def select_layer(self, index: int) -> None:
        """Move the row cursor to the layer with LayerInfo.index == index (if shown)."""
        for row, layer_row in enumerate(self._rows):
            if layer_row.index == index:
                self.table.move_cursor(row=row)
                return

    # -- internals ------------------------------------------------------------------------------

    def on_resize(self) -> None:
        if self._ready:
            self._refresh_table()

    def _display_columns(self, rows: list[LayerRow]) -> list[int]:
        """Every column when they fit the pane; else the compact K·V column and what else fits (PRIORITY)."""
        width = self.content_size.width
        labels = [label for _, label in (*COLUMNS, COMPACT_COLUMN)]
        cells = [row.cells for row in rows]
        if width <= 0:
            return list(range(len(COLUMNS)))
        full = fit_columns(labels[: len(COLUMNS)], [c[: len(COLUMNS)] for c in cells], range(len(COLUMNS)), width - 1)
        if len(full) == len(COLUMNS):
            return full
        narrow = [NARROW_LABELS.get(key, label) for key, label in (*COLUMNS, COMPACT_COLUMN)]
        return fit_columns(narrow, cells, PRIORITY, width - 1)

    def _refresh_table(self, force: bool = False) -> None:
        new_rows = [
            row._replace(cells=(*row.cells, Text(compact_shape(layer))))
            for row, layer in zip(
                layer_rows(self._snapshot, self._palette), self._snapshot.layers if self._snapshot else ()
            )
        ]
        shown = self._display_columns(new_rows)
        all_columns = (*COLUMNS, COMPACT_COLUMN)
        table = self.table
        if shown != self._shown_columns:
            table.clear(columns=True)
            narrow = len(COLUMNS) in shown  # the compact K·V column: the narrow labels
            for i in shown:
                key, label = all_columns[i]
                table.add_column(NARROW_LABELS.get(key, label) if narrow else label, key=key)
            self._shown_columns, self._rows, force = shown, [], True
        new_rows = [row._replace(cells=tuple(row.cells[i] for i in shown)) for row in new_rows]
        decoding = self._snapshot is not None and self._snapshot.phase == "decode"
        update_rows(table, self._rows, new_rows, [all_columns[i][0] for i in shown], force=force, widen_only=decoding)
        self._rows = new_rows
        self._update_totals()
        self._sync_selection(post=True)

    def _update_totals(self) -> None:
        """The totals line; a paged cache: its groups' blocks above it (no layer rows: the table folds)."""
        snapshot = self._snapshot
        totals = render_totals(snapshot, self._query_heads, self._kv_heads, self._palette)
        paged = snapshot.paged if snapshot is not None else None
        if paged is not None:
            blocks = render_paged(paged, self._palette)
            if snapshot is not None and snapshot.layers:
                blocks.append("\n")
                blocks.append_text(totals)
            totals = blocks
        self.table.display = paged is None or bool(snapshot and snapshot.layers)
        self.border_title = "layers · paged cache" if paged is not None else "layers"
        self.query_one("#layers-totals", LiveText).show_text(totals)

    def _current_layer(self) -> int | None:
        row = self.table.cursor_row
        if 0 <= row < len(self._rows):
            return self._rows[row].index
        return None

    def _sync_selection(self, post: bool, always: bool = False) -> None:
        # Read the cursor as it is now, not as the event saw it: a rebuild (clear, add, move back)
        # then yields one consistent selection instead of a flicker through row 0.
        current = self._current_layer()
        changed = current != self._selected
        initial = self._selected is None
        self._selected = current
        if post and current is not None and (changed or always):
            self.post_message(self.LayerSelected(current, initial=initial and not always))

    @on(DataTable.RowHighlighted, "#layers-table")
    def _row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()
        self._sync_selection(post=True)

    @on(DataTable.RowSelected, "#layers-table")
    def _row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self._sync_selection(post=True, always=True)

"""The four snapshot panes: pure render functions, then each widget in a tiny host App."""

from __future__ import annotations

from math import prod

import pytest
from textual.app import App, ComposeResult
from textual.widgets import DataTable

from kvtui.engine.records.codes import CODES, Code
from kvtui.engine.records.snapshot import (
    SEVERITIES,
    BufferToken,
    Diagnostic,
    LayerInfo,
    StepSnapshot,
    TokenBuffer,
    TopToken,
)
from kvtui.widgets.step.chat_pane import ChatPane
from kvtui.widgets.step.cursor_pane import CursorPane, capacity_bar, format_positions, kind_summary, render_cursor
from kvtui.widgets.step.diagnostics_pane import (
    DiagnosticsPane,
    diagnostic_cells,
    render_detail,
    severity_counts,
    title_for,
    truncate,
)
from kvtui.widgets.step.layers_pane import (
    LayersPane,
    format_bytes,
    format_shape,
    head_summary,
    layer_cells,
    layer_rows,
    render_totals,
)
from kvtui.widgets.step.topk_pane import TopKPane, format_piece, format_prob, prob_bar, render_header, topk_rows

# ---------------------------------------------------------------------------------------------
# factory
# ---------------------------------------------------------------------------------------------


class ExplodingBuffer(TokenBuffer):
    """A buffer that fails if a pane reads it token by token (panes must stay O(layers)/O(k))."""

    def __iter__(self):
        raise AssertionError("a pane iterated snapshot.buffer")

    def __getitem__(self, index):
        raise AssertionError("a pane indexed snapshot.buffer")


@pytest.fixture(autouse=True)
def synthetic_codes(monkeypatch):
    """The panes are drawn with made-up codes (CODE_0 ...): registered for these tests only (a Diagnostic refuses
    a code the registry does not list)."""
    for name in [f"CODE_{i}" for i in range(64)] + ["CURSOR_MISMATCH"]:
        monkeypatch.setitem(CODES, name, Code(name, SEVERITIES, "any (a pane test's code)", "a pane test's code"))


def make_layer(
    index: int,
    kind: str = "full",
    filled: int = 37,
    *,
    capacity: int | None = None,
    window: int | None = None,
    seen: int | None = None,
    held_from: int = 0,
    kv_heads: int = 2,
    head_dim: int = 16,
    dtype: str = "float32",
    device: str = "cpu",
) -> LayerInfo:
    slots = capacity if capacity is not None else filled
    shape = (1, kv_heads, slots, head_dim)
    return LayerInfo(
        index=index,
        kind=kind,
        k_shape=shape,
        v_shape=shape,
        dtype=dtype,
        device=device,
        bytes=2 * prod(shape) * 4,
        filled=filled,
        capacity=capacity,
        window=window,
        seen=filled if seen is None else seen,
        held_from=held_from,
    )


def tok(token_id: int, text: str, prob: float, logit: float = 1.0, rank: int = 0) -> TopToken:
    return TopToken(id=token_id, text=text, logit=logit, prob=prob, rank=rank)


RAW = (
    tok(11, " the", 0.50, 9.5, 1),
    tok(22, " a", 0.25, 8.8, 2),
    tok(33, "\n", 0.125, 8.1, 3),
    tok(44, "[b]x", 0.05, 7.2, 4),
)
PROCESSED = (tok(11, " the", 0.60, 9.5, 1), tok(22, " a", 0.30, 8.8, 2), tok(33, "\n", 0.10, 8.1, 3))
WATCHED = (tok(99, " zebra", 0.0004, -2.0, 731),)


def make_snapshot(
    *,
    step: int = 5,
    phase: str = "decode",
    cursor: int = 37,
    cache_seq_length: int | None = None,
    capacity: int | None = None,
    layers: tuple[LayerInfo, ...] | None = None,
    positions: tuple[int, ...] = (36,),
    topk: tuple[TopToken, ...] = RAW,
    topk_processed: tuple[TopToken, ...] = PROCESSED,
    watched: tuple[TopToken, ...] = WATCHED,
    chosen: TopToken | None = PROCESSED[0],
    chosen_forced: bool = False,
    diagnostics: tuple[Diagnostic, ...] = (),
    buffer: TokenBuffer | None = None,
) -> StepSnapshot:
    if cache_seq_length is None:
        cache_seq_length = cursor
    if layers is None:
        layers = (make_layer(0, filled=cache_seq_length), make_layer(1, filled=cache_seq_length))
    if buffer is None:
        buffer = TokenBuffer(
            [
                BufferToken(position=i, id=100 + i, piece=f"t{i}", special=False, origin="user", turn=1)
                for i in range(cache_seq_length)
            ]
        )
    return StepSnapshot(
        step=step,
        phase=phase,
        turn=1,
        input_ids=tuple(range(len(positions))),
        positions=positions,
        cursor=cursor,
        cache_seq_length=cache_seq_length,
        capacity=capacity,
        layers=layers,
        topk=topk,
        topk_processed=topk_processed,
        watched=watched,
        chosen=chosen,
        chosen_forced=chosen_forced,
        diagnostics=diagnostics,
        forward_ms=12.5,
        snapshot_ms=0.4,
        buffer=buffer,
    )


def make_diagnostics(n: int, start_step: int = 1) -> list[Diagnostic]:
    severities = ("info", "warning", "error")
    return [
        Diagnostic(code=f"CODE_{i}", severity=severities[i % 3], message=f"message number {i}", step=start_step + i)
        for i in range(n)
    ]


def plain(cells) -> list[str]:
    return [getattr(cell, "plain", str(cell)) for cell in cells]


# ---------------------------------------------------------------------------------------------
# host app
# ---------------------------------------------------------------------------------------------


class HostApp(App):
    CSS = """
    CursorPane { height: auto; }
    LayersPane, TopKPane, DiagnosticsPane { height: 12; }
    """

    def __init__(self) -> None:
        super().__init__()
        self.layer_selected: list[int] = []
        self.forces: list[tuple[int, str]] = []
        self.jumps: list[tuple[int, Diagnostic]] = []
        self.stray: list[object] = []

    def compose(self) -> ComposeResult:
        yield CursorPane(id="cursor")
        yield LayersPane(id="layers")
        yield TopKPane(id="topk")
        yield DiagnosticsPane(id="diagnostics")

    def on_layers_pane_layer_selected(self, message: LayersPane.LayerSelected) -> None:
        self.layer_selected.append(message.index)

    # Textual derives the handler name from the class name: TopKPane -> "top_kpane".
    def on_top_kpane_force(self, message: TopKPane.Force) -> None:
        self.forces.append((message.token_id, message.text))

    def on_diagnostics_pane_jump_to(self, message: DiagnosticsPane.JumpTo) -> None:
        self.jumps.append((message.step, message.diagnostic))

    def on_data_table_row_selected(self, message: DataTable.RowSelected) -> None:
        self.stray.append(message)  # the panes translate these; none should reach the app


def static_text(widget) -> str:
    return widget.visual.plain


# ---------------------------------------------------------------------------------------------
# cursor pane
# ---------------------------------------------------------------------------------------------


def test_render_cursor_shows_step_cursor_cache_length_and_positions():
    snap = make_snapshot(step=7, phase="prefill", cursor=53, positions=tuple(range(37, 53)))
    text = render_cursor(snap).plain
    assert "step 7" in text and "prefill" in text
    assert "cursor 53" in text and "cache length 53" in text
    assert "37..52 (16 tokens)" in text
    assert "ALARM" not in text


def test_render_cursor_alarm_only_when_cursor_differs():
    assert "ALARM" not in render_cursor(make_snapshot(cursor=40, cache_seq_length=40)).plain
    text = render_cursor(make_snapshot(cursor=40, cache_seq_length=44)).plain
    assert "ALARM cursor 40 ≠ cache length 44" in text


def test_render_cursor_none():
    assert "no step" in render_cursor(None).plain


def test_format_positions():
    assert format_positions(()) == "-"
    assert format_positions((53,)) == "53"
    assert format_positions(tuple(range(37, 53))) == "37..52 (16 tokens)"
    assert "not contiguous" in format_positions((1, 5, 9))


def test_kind_summary_when_sliding_layers_hold_fewer():
    layers = (
        make_layer(0, "full", 120),
        make_layer(1, "sliding", 7, window=8, seen=120, held_from=113),
    )
    snap = make_snapshot(cursor=120, layers=layers)
    assert kind_summary(snap) == "full 120 · sliding 7 held of 120 seen (window 8)"
    assert "full 120 · sliding 7 held" in render_cursor(snap).plain
    # all layers agree: nothing to explain
    assert kind_summary(make_snapshot(cursor=37)) is None


def test_render_cursor_static_capacity_bar():
    layers = (make_layer(0, "static", 37, capacity=64),)
    text = render_cursor(make_snapshot(cursor=37, capacity=64, layers=layers)).plain
    assert "37/64" in text and "58%" in text
    assert "█" in text
    assert capacity_bar(0, 10, width=10) == "░" * 10
    assert capacity_bar(10, 10, width=10) == "█" * 10
    assert "capacity" not in render_cursor(make_snapshot()).plain  # dynamic: no bar


async def test_cursor_pane_alarm_in_app():
    app = HostApp()
    async with app.run_test(size=(120, 40)) as pilot:
        pane = app.query_one(CursorPane)
        assert pane.border_title == "cursor"
        pane.show(make_snapshot(cursor=40, buffer=ExplodingBuffer([], 40)))
        await pilot.pause()
        text = static_text(pane)
        assert "cursor 40" in text and "cache length 40" in text
        assert "ALARM" not in text and not pane.has_class("-alarm") and not pane.alarm

        pane.show(make_snapshot(cursor=40, cache_seq_length=44, buffer=ExplodingBuffer([], 44)))
        await pilot.pause()
        assert "ALARM cursor 40 ≠ cache length 44" in static_text(pane)
        assert pane.has_class("-alarm") and pane.alarm

        pane.show(make_snapshot(cursor=45, cache_seq_length=45))
        await pilot.pause()
        assert "ALARM" not in static_text(pane) and not pane.has_class("-alarm")

        pane.show(None)
        await pilot.pause()
        assert "no step" in static_text(pane)


# ---------------------------------------------------------------------------------------------
# layers pane
# ---------------------------------------------------------------------------------------------


def test_format_helpers():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 1024 * 1024) == "3.0 MiB"
    assert format_shape((1, 2, 37, 16)) == "1×2×37×16"


def test_layer_cells():
    cells = plain(layer_cells(make_layer(3, "full", 37)))
    # index, kind, bytes, filled/cap, window, K, V, dtype, device
    assert cells == ["3", "full", "9.2 KiB", "37/∞", "-", "1×2×37×16", "1×2×37×16", "float32", "cpu"]
    static = plain(layer_cells(make_layer(0, "static-sliding", 8, capacity=8, window=8, seen=40, held_from=32)))
    assert static[5] == "1×2×8×16" and static[3] == "8/8" and static[4] == "8 from 32"


def test_render_totals_and_heads():
    snap = make_snapshot(layers=(make_layer(0, "full", 37), make_layer(1, "sliding", 8, window=8, seen=37)))
    text = render_totals(snap, query_heads=4, kv_heads=2).plain
    assert format_bytes(snap.cache_bytes) in text
    assert "2 layers (1 full, 1 sliding)" in text
    assert "KV heads 2 vs query heads 4 (GQA ×2)" in text
    assert "float32 on cpu" in text  # every layer shares them: said once
    # kv heads read from the K shape when not given
    assert "KV heads 2" in render_totals(snap).plain
    assert head_summary(4, 4).endswith("(MHA)") and head_summary(8, 1).endswith("(MQA)")
    assert "no layers" in render_totals(None).plain


async def test_columns_widen_while_decoding_and_narrow_at_a_prefill():
    """While the model decodes a narrower value leaves its column as it was (re-measuring would resize the
    table and lay out the screen at every step); a wider one widens it; a prefill lets it narrow again."""
    app = HostApp()
    async with app.run_test(size=(120, 40)) as pilot:
        pane = app.query_one(LayersPane)
        pane.show(make_snapshot(cursor=100000))
        await pilot.pause()
        table = pane.table
        assert table.columns["k_shape"].content_width == len("1×2×100000×16")
        size = table.virtual_size
        pane.show(make_snapshot(cursor=38))
        await pilot.pause()
        assert table.get_cell_at((0, 5)).plain == "1×2×38×16"
        assert table.columns["k_shape"].content_width == len("1×2×100000×16") and table.virtual_size == size
        pane.show(make_snapshot(cursor=1000000))
        await pilot.pause()
        assert table.columns["k_shape"].content_width == len("1×2×1000000×16")
        pane.show(make_snapshot(cursor=38, phase="prefill"))
        await pilot.pause()
        assert table.columns["k_shape"].content_width == len("1×2×38×16")


def test_layer_rows_keys():
    rows = layer_rows(make_snapshot())
    assert [r.key for r in rows] == ["layer-0", "layer-1"] and [r.index for r in rows] == [0, 1]
    assert layer_rows(None) == []


async def test_layers_pane_rows_update_in_place_and_selection():
    app = HostApp()
    async with app.run_test(size=(120, 40)) as pilot:
        pane = app.query_one(LayersPane)
        assert pane.border_title == "layers"
        pane.set_model_info(query_heads=4, kv_heads=2)
        pane.show(make_snapshot(cursor=37, buffer=ExplodingBuffer([], 37)))
        await pilot.pause()
        table = pane.table
        assert table.row_count == 2
        row = plain(table.get_row_at(0))
        assert row[0] == "0" and row[5] == "1×2×37×16" and row[2] == "9.2 KiB" and row[3] == "37/∞"
        assert "KV heads 2 vs query heads 4" in static_text(pane.query_one("#layers-totals"))
        keys = [r.key for r in table.ordered_rows]

        # same layer count: cells change, rows (keys) are reused
        pane.show(make_snapshot(cursor=38))
        await pilot.pause()
        assert [r.key for r in table.ordered_rows] == keys
        assert all(a is b for a, b in zip((r.key for r in table.ordered_rows), keys))
        assert plain(table.get_row_at(1))[3] == "38/∞"
        assert table.get_cell_at((0, 5)).plain == "1×2×38×16"

        # a wider value in place widens its column (DataTable only re-measures when told to)
        pane.show(make_snapshot(cursor=100000))
        await pilot.pause()
        assert table.columns["filled"].content_width >= len("100000/∞")
        assert table.columns["bytes"].content_width >= len(format_bytes(2 * 2 * 100000 * 16 * 4))
        pane.show(make_snapshot(cursor=38))
        await pilot.pause()

        # moving the cursor posts LayerSelected
        table.focus()
        await pilot.press("down")
        await pilot.pause()
        assert app.layer_selected[-1] == 1 and pane.selected_layer == 1

        # a different layer count rebuilds, the cursor stays on the same row
        pane.show(make_snapshot(cursor=39, layers=tuple(make_layer(i, filled=39) for i in range(4))))
        await pilot.pause()
        assert table.row_count == 4 and table.cursor_row == 1 and pane.selected_layer == 1
        assert app.layer_selected[-1] == 1

        await pilot.press("down", "enter")
        await pilot.pause()
        assert app.layer_selected[-2:] == [2, 2]  # highlight, then enter re-posts
        assert not app.stray


# ---------------------------------------------------------------------------------------------
# top-k pane
# ---------------------------------------------------------------------------------------------


def test_format_piece_and_prob():
    assert format_piece(" the") == "' the'"
    assert format_piece("a\nb") == "'a↵b'"
    assert format_piece("\t\x00") == "'→\\x00'"  # the same token text as the buffer pane (fmt.token_text)
    assert format_piece("x" * 40).endswith("…'")
    assert format_prob(0.4213) == "42.1%"
    assert format_prob(0.0012) == "0.12%"
    assert format_prob(3e-7) == "<0.01%"
    assert format_prob(0.0) == "0%"
    assert prob_bar(1.0, 4) == "████" and prob_bar(0.5, 4) == "██  " and prob_bar(0.0, 4) == "    "


def test_topk_rows_processed_default():
    rows = topk_rows(make_snapshot())
    assert [r.key for r in rows] == ["top-0", "top-1", "top-2", "watch-0"]
    first = plain(rows[0].cells)  # mark, rank, token, id, prob, bar, other(raw), logit
    assert first[0].startswith("▶") and first[1] == "1" and first[2] == "' the'" and first[3] == "11"
    assert first[4] == "60.0%" and first[6] == "50.0%" and first[7] == "9.50"
    assert "█" in first[5]
    assert plain(rows[2].cells)[2] == "'↵'"
    assert not plain(rows[1].cells)[0].startswith("▶")
    watched = plain(rows[3].cells)
    assert rows[3].watched and watched[1] == "#731" and watched[4] == "0.04%" and "◇" in watched[0]


def test_topk_rows_raw_and_forced():
    snap = make_snapshot(chosen=RAW[3], chosen_forced=True)
    rows = topk_rows(snap, "raw")
    assert [r.token.id for r in rows[:4]] == [11, 22, 33, 44]
    chosen = plain(rows[3].cells)
    assert chosen[0].startswith("▶") and chosen[2] == "'[b]x' (forced)"
    assert chosen[6] == "·"  # not in the processed top-k
    header = render_header(snap, "raw").plain
    assert "raw" in header and "▶ '[b]x'" in header and "id 44" in header and "(forced)" in header
    assert "processed" in render_header(make_snapshot()).plain


async def test_topk_pane_force_on_row_two_and_toggle():
    app = HostApp()
    async with app.run_test(size=(120, 40)) as pilot:
        pane = app.query_one(TopKPane)
        assert pane.border_title == "top-k"
        pane.show(make_snapshot(buffer=ExplodingBuffer([], 37)))
        await pilot.pause()
        table = pane.table
        assert table.row_count == 4
        assert plain(table.get_row_at(0))[2] == "' the'"
        assert table.get_cell_at((0, 0)).plain.startswith("▶")

        table.focus()
        await pilot.press("down", "down")  # row 2
        await pilot.pause()
        assert pane.selected_token_id == 33
        await pilot.press("f")
        await pilot.pause()
        assert app.forces == [(33, "\n")]
        await pilot.press("up", "enter")
        await pilot.pause()
        assert app.forces[-1] == (22, " a")

        # a new step with as many rows reuses them
        keys = [r.key for r in table.ordered_rows]
        pane.show(make_snapshot(chosen=PROCESSED[1], chosen_forced=True))
        await pilot.pause()
        assert all(a is b for a, b in zip((r.key for r in table.ordered_rows), keys))
        assert table.get_cell_at((1, 2)).plain == "' a' (forced)"

        # t: raw distribution, markup-looking pieces stay literal
        await pilot.press("t")
        await pilot.pause()
        assert pane.mode == "raw" and table.row_count == 5
        assert table.get_cell_at((3, 2)).plain == "'[b]x'"
        assert "raw" in static_text(pane.query_one("#topk-header"))
        assert not app.stray


# ---------------------------------------------------------------------------------------------
# diagnostics pane
# ---------------------------------------------------------------------------------------------


def test_diagnostic_helpers():
    d = Diagnostic(code="CURSOR_MISMATCH", severity="error", message="x" * 200, step=12)
    cells = plain(diagnostic_cells(d, width=40))
    assert cells[:3] == ["12", "error", "CURSOR_MISMATCH"]
    assert len(cells[3]) == 40 and cells[3].endswith("…")
    assert render_detail(d).plain.endswith("x" * 200)  # the full text
    assert truncate("a\nb") == "a b"
    counts = severity_counts(make_diagnostics(5))  # info, warning, error, info, warning
    assert counts == {"info": 2, "warning": 2, "error": 1}
    assert title_for(counts) == "diagnostics · 1 error · 2 warnings · 2 info"
    assert title_for({"error": 2, "warning": 1, "info": 0}) == "diagnostics · 2 errors · 1 warning"
    assert title_for(severity_counts([])) == "diagnostics"


async def test_diagnostics_pane_groups_leads_with_the_cause_and_jumps():
    app = HostApp()
    async with app.run_test(size=(120, 40)) as pilot:
        pane = app.query_one(DiagnosticsPane)
        all_diags = make_diagnostics(6, start_step=10)  # steps 10..15: info, warning, error, info, warning, error
        pane.show_diagnostics(all_diags[:3])
        await pilot.pause()
        table = pane.table
        assert table.row_count == 3
        # errors first, then warnings, then info; each a group of one: code, step, severity, first message
        assert plain(table.get_row_at(0)) == ["  CODE_2", "12", "error", "message number 2"]
        assert [plain(table.get_row_at(r))[2] for r in range(3)] == ["error", "warning", "info"]
        assert pane.border_title == "diagnostics · 1 error · 1 warning · 1 info"
        assert pane.has_class("-errors")
        # the first-fired error or warning is selected and shown in full: CODE_1 (warning, step 11) before CODE_2
        assert pane.selected_diagnostic == all_diags[1]
        assert "message number 1" in static_text(pane.query_one("#diagnostics-detail"))
        keys = [r.key for r in table.ordered_rows]

        # the same list again: nothing changes
        pane.show_diagnostics(list(all_diags[:3]))
        await pilot.pause()
        assert [r.key for r in table.ordered_rows] == keys

        # repeats of a code fold into its group: one row, count, first and last step
        repeats = [
            *all_diags[:3],
            Diagnostic("CODE_1", "warning", "again", 20),
            Diagnostic("CODE_1", "warning", "more", 38),
        ]
        pane.show_diagnostics(repeats)
        await pilot.pause()
        assert table.row_count == 3 and [r.key for r in table.ordered_rows] == keys  # rows updated in place
        row = plain(table.get_row_at(1))
        assert row[0] == "▸ CODE_1 ×3" and row[1] == "11–38" and row[3] == "message number 1"
        assert "CODE_1 ×3, steps 11–38" in static_text(pane.query_one("#diagnostics-detail"))

        # x expands the highlighted group into its alarms, and folds it again
        table.focus()
        table.move_cursor(row=1)
        await pilot.pause()
        await pilot.press("x")
        await pilot.pause()
        assert table.row_count == 6
        assert [plain(table.get_row_at(r))[1] for r in (2, 3, 4)] == ["11", "20", "38"]
        assert plain(table.get_row_at(1))[0].startswith("▾")
        # enter on an alarm of the group jumps to its step; on the group row to its first step
        table.move_cursor(row=3)
        await pilot.pause()
        await pilot.press("enter")
        await pilot.pause()
        assert app.jumps[-1] == (20, repeats[3])
        assert table.tooltip == "again"
        table.move_cursor(row=1)
        await pilot.pause()
        await pilot.press("enter")
        await pilot.pause()
        assert app.jumps[-1] == (11, all_diags[1])
        await pilot.press("x")
        await pilot.pause()
        assert table.row_count == 3

        # the whole list: 2 errors, 2 warnings, 2 info in 6 groups
        pane.show_diagnostics(all_diags)
        await pilot.pause()
        assert table.row_count == 6 and pane.border_title == "diagnostics · 2 errors · 2 warnings · 2 info"
        assert [plain(table.get_row_at(r))[0].strip() for r in range(6)] == [
            "CODE_2",
            "CODE_5",
            "CODE_1",
            "CODE_4",
            "CODE_0",
            "CODE_3",
        ]

        # shorter (a reset): rebuilt, the leading alarm selected again
        reset = make_diagnostics(2, start_step=1)
        pane.show_diagnostics(reset)
        await pilot.pause()
        assert table.row_count == 2
        assert plain(table.get_row_at(0))[1] == "2" and pane.selected_diagnostic == reset[1]
        assert pane.border_title == "diagnostics · 1 warning · 1 info" and not pane.has_class("-errors")

        pane.show_diagnostics([])
        await pilot.pause()
        assert table.row_count == 0 and pane.border_title == "diagnostics"
        pane.show(make_snapshot())  # accepted, no-op
        assert not app.stray


def test_group_diagnostics_and_leading_group():
    from kvtui.engine.records.diagnostic_groups import group_diagnostics, group_summary, leading_group

    found = [Diagnostic("ignored-argument", "warning", "cache_position ignored", step) for step in range(2, 39, 4)]
    found.insert(1, Diagnostic("pad-in-cache", "warning", "4 pad tokens", 3))
    found.append(Diagnostic("cursor-mismatch", "error", "cursor 5 vs 9", 7))
    found.append(Diagnostic("recomputed-prefix", "info", "re-encoded 9 tokens DynamicCache#1 held", 9))
    found.append(Diagnostic("recomputed-prefix", "info", "re-encoded 9 tokens DynamicCache#2 held", 12))
    groups = group_diagnostics(found)
    assert [(g.code, g.count) for g in groups] == [
        ("cursor-mismatch", 1),
        ("ignored-argument", 10),
        ("pad-in-cache", 1),
        ("recomputed-prefix", 1),
        ("recomputed-prefix", 1),
    ]
    assert groups[1].headline() == "ignored-argument ×10, steps 2–38"
    assert groups[3].cache == "DynamicCache#1" and groups[4].cache == "DynamicCache#2"  # by code and cache
    assert leading_group(groups).code == "ignored-argument"  # fired first (step 2) of the errors and warnings
    assert group_summary(groups[0]).startswith("step    7  cursor-mismatch, step 7  cursor 5 vs 9")
    assert leading_group([]) is None


async def test_panes_accept_snapshots_before_mount():
    app = HostApp()
    snap = make_snapshot(cursor=40, cache_seq_length=44)
    layers, topk, diags = LayersPane(), TopKPane(), DiagnosticsPane()
    layers.show(snap)
    topk.show(snap)
    diags.show_diagnostics(make_diagnostics(2))
    async with app.run_test(size=(120, 40)) as pilot:
        await app.mount(layers, topk, diags)
        await pilot.pause()
        assert layers.table.row_count == 2
        assert topk.table.row_count == 4
        assert diags.table.row_count == 2


@pytest.mark.parametrize("theme", ["textual-light", "nord"])
async def test_theme_change_rerenders(theme):
    app = HostApp()
    async with app.run_test(size=(120, 40)) as pilot:
        pane = app.query_one(TopKPane)
        pane.show(make_snapshot())
        cursor = app.query_one(CursorPane)
        cursor.show(make_snapshot(cursor=1, cache_seq_length=2))
        await pilot.pause()
        app.theme = theme
        await pilot.pause()
        await pilot.pause()
        error = app.theme_variables["error"]
        assert pane.table.row_count == 4
        assert any(error.lower() in str(span.style).lower() for span in cursor.content.spans)


class _TableApp(App):
    def compose(self) -> ComposeResult:
        yield DataTable()


async def test_a_rebuilt_table_is_as_wide_as_its_new_rows():
    """update_rows rebuilding a table (other row keys): each column takes the widest of its label and the new
    cells, narrower or wider than before, at once. A column left at its label's width until the table's idle
    re-measure drew every alarm code of the diagnostics pane cut to three letters ('cur' for cursor-mismatch)
    in the frames between (seen in the watch TUI; a layout test failed on it under load)."""
    from rich.text import Text

    from kvtui.widgets.shared.table_rows import update_rows

    class Row:
        def __init__(self, key, *cells):
            self.key, self.cells = key, tuple(Text(c) for c in cells)

    app = _TableApp()
    async with app.run_test(size=(100, 20)):
        table = app.query_one(DataTable)
        table.add_column("alarm", key="code")
        table.add_column("n", key="count")
        wide = [Row("a", "cursor-mismatch", "2"), Row("b", "pad-in-cache", "10")]
        update_rows(table, [], wide, ["code", "count"])
        # at once, not only after the table's own idle re-measure: a frame drawn in between cut the codes
        assert table.columns["code"].content_width == len("cursor-mismatch")
        assert table.columns["count"].content_width == len("n") + 1  # "10" is wider than the label
        narrow = [Row("c", "x", "1")]
        update_rows(table, wide, narrow, ["code", "count"])
        assert table.columns["code"].content_width == len("alarm")  # the label, the widest now


def test_the_server_pane_shows_the_fleet_and_the_stream_integrity():
    from rich.console import Console

    from kvtui.engine.reading.token_texts import TokenTexts
    from kvtui.engine.server.kv_events import BlocksStored, EventBatch
    from kvtui.engine.server.prefix_cache import PrefixCache
    from kvtui.engine.server.view import stats_view
    from kvtui.widgets.server.server_stats import fleet_line, render_table

    cache = PrefixCache(TokenTexts())
    prompt = tuple(range(100, 132))
    cache.apply(EventBatch(0, 0.0, (BlocksStored(("a0", "a1"), None, prompt, 16),)), "h:1")
    # stored while held (under its parent: from the prompt's start, held blocks again are vLLM's report of hits)
    cache.apply(EventBatch(1, 0.0, (BlocksStored(("a1",), "a0", prompt[16:], 16),)), "h:1")
    cache.apply(EventBatch(0, 0.0, (BlocksStored(("b0", "b1"), None, prompt, 16),)), "h:2")
    view = stats_view(cache)
    assert fleet_line(view) == (
        "\nfleet: routing waste 32 tokens (prefilled while another replica held them) · held twice 64"
    )
    console = Console(width=200, record=True)
    console.print(render_table(view))
    text = console.export_text()
    assert "unknown" in text and "dup hash" in text and "routed" in text
    row = next(line for line in text.splitlines() if line.startswith("h:1"))
    assert row.split()[-3:] == ["0", "1", "0"]  # unknown removed, dup hash, routed
    assert fleet_line(stats_view(PrefixCache(TokenTexts()))) == ""


def test_the_server_table_fits_or_falls_back_to_lines_with_every_column():
    """The width check, the table and the narrow lines read one column list: a fleet's origins, its routed and
    integrity columns are measured and kept in the narrow form (they were dropped there, and the width check
    left them out, so a 90-cell pane squeezed the table until the origins were cut to `localhost:8…`)."""
    from rich.console import Console

    from kvtui.engine.reading.token_texts import TokenTexts
    from kvtui.engine.server.kv_events import BlocksStored, EventBatch
    from kvtui.engine.server.prefix_cache import PrefixCache
    from kvtui.engine.server.view import stats_view
    from kvtui.widgets.server.server_stats import render_lines, render_table, table_width

    cache = PrefixCache(TokenTexts())
    prompt = tuple(range(100, 132))
    cache.apply(EventBatch(0, 0.0, (BlocksStored(("a0", "a1"), None, prompt, 16),)), "localhost:8000")
    cache.apply(EventBatch(0, 0.0, (BlocksStored(("b0", "b1"), None, prompt, 16),)), "localhost:8001")
    view = stats_view(cache)
    width = table_width(view)
    headers = ("stored", "removed", "held", "capacity", "lost", "undecodable", "restored", "unknown", "dup hash")
    assert width == len("localhost:8000") + sum(len(h) + 2 for h in (*headers, "routed"))  # each column, 2 between
    console = Console(width=width, record=True)
    console.print(render_table(view))
    table = console.export_text()
    assert "localhost:8000" in table and "localhost:8001" in table and "…" not in table  # nothing cut
    lines = render_lines(view).plain.splitlines()
    assert lines[1] == (
        "localhost:8001: stored 2 · removed 0 · held 2 of ? · lost 0 · undecodable 0 · restored 0 · "
        "unknown 0 · dup hash 0 · routed 32"
    )


def test_count_sparklines_start_at_zero():
    """Counts and hit rates are drawn from zero (Textual's plot scales from the series' minimum: a lone 0 filled
    the row and a constant 128 lay at the bottom)."""
    from rich.color import Color
    from rich.console import Console

    from kvtui.widgets.shared.count_sparkline import ZeroBasedRenderable

    def drawn(data, ceiling=None, height=1):
        console = Console(width=8, record=True, color_system=None)
        colors = {"min_color": Color.parse("green"), "max_color": Color.parse("red")}
        console.print(ZeroBasedRenderable(data, ceiling=ceiling, width=8, height=height, **colors))
        return console.export_text().rstrip("\n")

    assert drawn([0]) == "▁" * 8
    assert drawn([0, 0, 0]) == "▁" * 8
    assert drawn([128]) == "█" * 8
    assert drawn([128, 128]) == "█" * 8
    assert drawn([0, 128]) == "▁" * 4 + "█" * 4
    assert drawn([0.5], ceiling=1.0) == "▄" * 8  # half of 100 %: int(0.5 * 7) = 3, the fourth bar
    assert drawn([1.0, 0.0], ceiling=1.0, height=2) == "████    \n████▁▁▁▁"
    assert drawn(list(range(16))) == "▁▂▃▄▅▆▇█"  # 16 samples in 8 columns, each its bucket's maximum: 1, 3, ... 15


def test_the_server_table_adds_the_media_columns_once_a_server_offloads_or_names_an_unknown_medium():
    from kvtui.engine.reading.token_texts import TokenTexts
    from kvtui.engine.server.kv_events import BlocksRemoved, BlocksStored, EventBatch
    from kvtui.engine.server.prefix_cache import PrefixCache
    from kvtui.engine.server.view import stats_view
    from kvtui.widgets.server.server_stats import stat_columns

    cache = PrefixCache(TokenTexts())
    prompt = tuple(range(100, 132))
    cache.apply(EventBatch(0, 0.0, (BlocksStored(("a0", "a1"), None, prompt, 16, medium="GPU"),)), "h:1")
    assert "kept on a tier" not in stat_columns(stats_view(cache))[0]  # one medium: no columns for tiers
    cache.apply(EventBatch(1, 1.0, (BlocksStored(("a0", "a1"), None, prompt, 16, medium="CPU"),)), "h:1")
    cache.apply(EventBatch(2, 2.0, (BlocksRemoved(("a0", "a1"), medium="GPU"),)), "h:1")  # the CPU tier keeps them
    cache.apply(EventBatch(3, 3.0, (BlocksStored(("a0", "a1"), None, prompt, 16, medium="GPU"),)), "h:1")  # back
    cache.apply(EventBatch(4, 4.0, (BlocksStored(("n0",), None, tuple(range(16)), 16, medium="NVME"),)), "h:1")
    names, (cells,) = stat_columns(stats_view(cache))
    shown = dict(zip(names, cells))
    assert (shown["unknown medium"], shown["kept on a tier"], shown["loaded back"]) == ("1", "2", "2")


# ---------------------------------------------------------------------------------------------
# chat pane
# ---------------------------------------------------------------------------------------------


class ChatHost(App):
    def compose(self) -> ComposeResult:
        yield ChatPane(id="chat")


async def test_chat_pane_repaints_a_rewritten_transcript_before_its_old_messages_are_removed():
    """A followed trace rewritten (or a rewind) starts the transcript again; the next repaint can come before
    Textual has removed the old messages: it shows the new ones, never the old, and raises nothing."""
    user = {"role": "user", "content": "What is k?"}
    app = ChatHost()
    async with app.run_test() as pilot:
        chat = app.query_one(ChatPane)
        chat.show_messages([user, {"role": "assistant", "content": "k is 5."}])
        await pilot.pause()
        again = {"role": "user", "content": "Again?"}
        chat.show_messages([again])  # starts again: the old two are being removed (Textual prunes them later)
        chat.show_messages([again, {"role": "assistant", "content": "Yes"}, {"role": "user", "content": "And?"}])
        await pilot.pause()
        shown = [str(widget.visual) for widget in app.query("#transcript LiveText")]
        assert shown == ["user: Again?", "assistant: Yes", "user: And?"]


async def test_chat_pane_shows_the_unfinished_character_a_reply_ends_on_as_its_bytes():
    """A reply generated into the middle of an emoji ends on bytes a decoder shows as U+FFFD: one for Python's and
    byte-level BPE's decode, one per byte for SentencePiece's byte fallback. The pane shows those bytes instead, and
    leaves a message alone when the cache does not end inside a character."""
    app = ChatHost()
    async with app.run_test() as pilot:
        chat = app.query_one(ChatPane)
        user = {"role": "user", "content": "Say hi \ufffd"}  # a U+FFFD the user typed: not the cache's tail
        for content in ("Hi 🌟\ufffd", "Hi 🌟\ufffd\ufffd"):
            chat.show_messages([user, {"role": "assistant", "content": content}], unfinished=b"\xf0\x9f")
            await pilot.pause()
            shown = [str(widget.visual) for widget in app.query("#transcript LiveText")]
            assert shown == ["user: Say hi \ufffd", "assistant: Hi 🌟⟨f0 9f⟩"], content
        chat.show_messages([user, {"role": "assistant", "content": "Hi 🌟🌟"}])
        await pilot.pause()
        assert str(list(app.query("#transcript LiveText"))[-1].visual) == "assistant: Hi 🌟🌟"

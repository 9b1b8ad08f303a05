"""TokenBufferPane: a virtualized (Line API) grid of every cached token."""

from __future__ import annotations

from collections.abc import Sequence

from textual.app import App, ComposeResult

from kvtui.engine.records.snapshot import BufferToken, LayerInfo, StepSnapshot, TokenBuffer, TopToken
from kvtui.widgets.step.token_buffer import TokenBufferPane, display_piece, fit

SIZE = (100, 30)


# ---------------------------------------------------------------- factories


def make_tokens(n: int, *, prefix: str = "w", origin: str = "assistant", start_position: int = 0) -> list[BufferToken]:
    return [
        BufferToken(
            position=start_position + i, id=1000 + i, piece=f"{prefix}{i}", special=False, origin=origin, turn=1
        )
        for i in range(n)
    ]


def layer(index: int, *, kind: str = "full", window: int | None = None, seen: int = 0, held_from: int = 0) -> LayerInfo:
    slots = seen - held_from
    return LayerInfo(
        index=index,
        kind=kind,
        k_shape=(1, 2, slots, 8),
        v_shape=(1, 2, slots, 8),
        dtype="float32",
        device="cpu",
        bytes=slots * 2 * 2 * 8 * 4,
        filled=slots,
        capacity=window,
        window=window,
        seen=seen,
        held_from=held_from,
    )


def make_snapshot(
    buffer: Sequence[BufferToken],
    *,
    fed: int = 1,
    chosen: str | None = "Hi",
    layers: tuple[LayerInfo, ...] | None = None,
    cursor: int | None = None,
) -> StepSnapshot:
    n = len(buffer)
    if cursor is None:
        cursor = buffer[-1].position + 1 if n else 0
    if layers is None:
        layers = (layer(0, seen=n),)
    fed = min(fed, n)
    return StepSnapshot(
        step=1,
        phase="decode",
        turn=1,
        input_ids=tuple(range(fed)),
        positions=tuple(range(cursor - fed, cursor)),
        cursor=cursor,
        cache_seq_length=n,
        capacity=None,
        layers=layers,
        topk=(),
        topk_processed=(),
        watched=(),
        chosen=None if chosen is None else TopToken(id=7, text=chosen, logit=1.0, prob=0.5),
        chosen_forced=False,
        diagnostics=(),
        forward_ms=1.0,
        snapshot_ms=0.1,
        buffer=buffer if isinstance(buffer, (TokenBuffer, CountingBuffer)) else TokenBuffer(list(buffer)),
    )


class CountingBuffer(Sequence):
    """A buffer that counts how many tokens are read from it, and refuses to be iterated."""

    def __init__(self, items: list[BufferToken]):
        self._items = items
        self.reads = 0

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index):
        result = self._items[index]
        self.reads += len(result) if isinstance(index, slice) else 1
        return result

    def __iter__(self):
        raise AssertionError("the pane must not iterate the whole buffer")


class Host(App):
    def __init__(self) -> None:
        super().__init__()
        self.selected: list[TokenBufferPane.Selected] = []

    def compose(self) -> ComposeResult:
        yield TokenBufferPane()

    def on_token_buffer_pane_selected(self, message: TokenBufferPane.Selected) -> None:
        self.selected.append(message)


def lines(pane: TokenBufferPane) -> list[str]:
    return [pane.render_line(y).text for y in range(pane.scrollable_content_region.height)]


def segment_for(pane: TokenBufferPane, y: int, text: str):
    """The segment of rendered line y whose text starts with `text`."""
    for segment in pane.render_line(y):
        if segment.text.startswith(text):
            return segment
    raise AssertionError(f"{text!r} not on line {y}: {pane.render_line(y).text!r}")


# ---------------------------------------------------------------- pure helpers


def test_display_piece_escapes_and_truncates():
    assert display_piece("\n") == "↵"
    assert display_piece("\t") == "→"
    assert display_piece("   ") == "···"
    assert display_piece(" \n") == "·↵"
    assert display_piece(" the") == " the"  # spaces inside text stay spaces
    assert display_piece("\x1b") == "\\x1b"
    assert display_piece("a\u200bb") == "a\\u200bb"
    assert display_piece("") == "∅"
    assert fit("abc", 5) == "abc  "
    assert fit("abcdefgh", 5) == "abcd…"
    assert fit("漢字漢字", 5) == "漢字…"  # cut by cells, not characters


# ---------------------------------------------------------------- rendering


async def test_renders_pieces_and_row_positions():
    app = Host()
    async with app.run_test(size=SIZE) as pilot:
        pane = app.query_one(TokenBufferPane)
        tokens = make_tokens(60, start_position=100)  # positions differ from indices
        pane.show(make_snapshot(tokens))
        await pilot.pause()
        cols = pane._grid.cols
        assert cols >= 4
        rendered = lines(pane)
        for row in range(3):
            first = row * cols
            assert rendered[row].lstrip().startswith(str(100 + first)), rendered[row]
            for i in range(first, first + cols):
                assert f"w{i}" in rendered[row]
        # the ghost cell with the pending token follows the last token
        last_row = 59 // cols
        assert "w59" in rendered[last_row]
        assert "▌Hi" in rendered[(60) // cols]
        assert pane.virtual_size.height == -(-61 // cols)
        assert "60 tokens" in pane.border_title and "next pos 160" in pane.border_title


async def test_empty_and_none():
    app = Host()
    async with app.run_test(size=SIZE) as pilot:
        pane = app.query_one(TokenBufferPane)
        await pilot.pause()
        assert "cache empty — send a message" in pane.render_line(0).text
        pane.show(make_snapshot(make_tokens(5)))
        await pilot.pause()
        assert "w4" in pane.render_line(0).text
        pane.show(make_snapshot([]))
        await pilot.pause()
        assert "cache empty — send a message" in pane.render_line(0).text
        assert pane.selected_index is None
        pane.show(None)
        await pilot.pause()
        assert "cache empty" in pane.render_line(0).text
        assert pane.render_line(1).text.strip() == ""


async def test_special_origin_last_forward_and_cursor_styles():
    app = Host()
    async with app.run_test(size=SIZE) as pilot:
        pane = app.query_one(TokenBufferPane)
        tokens = [
            BufferToken(0, 1, "<bos>", True, "tokenizer-added", 0),
            BufferToken(1, 2, "<|im_start|>", True, "template", 1),
            BufferToken(2, 3, "user", False, "template", 1),
            BufferToken(3, 4, "hello", False, "user", 1),
            BufferToken(4, 5, "there", False, "user", 1),
            BufferToken(5, 6, "\n", False, "template", 1),
            BufferToken(6, 7, "alpha", False, "assistant", 1),
            BufferToken(7, 8, "beta", False, "assistant", 1),
            BufferToken(8, 9, "gamma", False, "assistant", 1),
        ]
        pane.show(make_snapshot(tokens, fed=2, chosen="delta"))
        await pilot.pause()
        text = pane.render_line(0).text
        assert "<|im_start|>" in text and "↵" in text  # a special token whole (issue 26), newline shown
        assert pane._grid.cell == len("<|im_start|>") + 1  # the grid widened for it

        special = segment_for(pane, 0, "<|im_start|>")
        template = segment_for(pane, 0, "user")
        assert special.style != template.style
        assert special.style.bold and not template.style.bold
        # origins are told apart by colour
        user = segment_for(pane, 0, "hello")
        alpha = segment_for(pane, 6 // pane._grid.cols, "alpha")
        assert user.style.color != alpha.style.color != template.style.color
        # the last forward (2 tokens fed: beta, gamma) is highlighted, alpha is not
        row = 7 // pane._grid.cols  # the grid widened for <|im_start|>: beta and gamma may sit on the next row
        beta = segment_for(pane, row, "beta")
        gamma = segment_for(pane, 8 // pane._grid.cols, "gamma")
        assert beta.style == gamma.style
        assert beta.style.bgcolor != alpha.style.bgcolor
        assert beta.style.color == alpha.style.color  # same origin colour, different background
        # the cursor cell shows the pending token in its own style
        ghost = segment_for(pane, len(tokens) // pane._grid.cols, "▌delta")
        assert ghost.style not in (alpha.style, beta.style)
        assert ghost.style.bold and ghost.style.bgcolor != alpha.style.bgcolor
        assert pane.describe(1) == "pos 1 · id 2 · '<|im_start|>' · template · turn 1 · special"


async def test_evicted_tokens_of_selected_sliding_layer():
    app = Host()
    async with app.run_test(size=SIZE) as pilot:
        pane = app.query_one(TokenBufferPane)
        # 4 pad tokens were primed, so positions restart: evictions follow buffer indices, not positions
        tokens = [BufferToken(0, 0, "<pad>", True, "primed", 0) for _ in range(4)] + make_tokens(8)
        layers = (layer(0, seen=12), layer(1, kind="sliding", window=4, seen=12, held_from=8))
        pane.show(make_snapshot(tokens, layers=layers))
        await pilot.pause()
        before = {t: segment_for(pane, 0, t).style for t in ("w3", "w4")}
        assert before["w3"] == before["w4"]

        pane.selected_layer = 1
        await pilot.pause()
        w3, w4 = segment_for(pane, 0, "w3"), segment_for(pane, 0, "w4")  # index 7 (evicted), index 8 (held)
        assert w3.style != w4.style
        assert w3.style.strike and not w4.style.strike
        assert w4.style == before["w4"]
        assert segment_for(pane, 0, "<pad>").style.strike
        assert "evicted from layer 1" in pane.describe(7)
        assert "evicted" not in pane.describe(8)
        assert "layer 1 sliding" in pane.border_title

        pane.selected_layer = 0  # a full layer evicts nothing
        await pilot.pause()
        assert not segment_for(pane, 0, "w3").style.strike
        pane.selected_layer = None
        await pilot.pause()
        assert segment_for(pane, 0, "w3").style == before["w3"]


async def test_attention_shading():
    app = Host()
    async with app.run_test(size=SIZE) as pilot:
        pane = app.query_one(TokenBufferPane)
        pane.show(make_snapshot(make_tokens(10), fed=1))
        await pilot.pause()
        plain = segment_for(pane, 0, "w1").style
        pane.attention = [0.0, 1.0, 0.5]  # shorter than the buffer: the rest is unshaded
        await pilot.pause()
        assert segment_for(pane, 0, "w0").style == plain
        assert segment_for(pane, 0, "w1").style.bgcolor != plain.bgcolor
        assert segment_for(pane, 0, "w2").style.bgcolor not in (plain.bgcolor, segment_for(pane, 0, "w1").style.bgcolor)
        assert segment_for(pane, 0, "w5").style == plain


# ---------------------------------------------------------------- selection


async def test_keyboard_and_mouse_selection_posts_selected():
    app = Host()
    async with app.run_test(size=SIZE) as pilot:
        pane = app.query_one(TokenBufferPane)
        tokens = make_tokens(50, start_position=10)
        pane.show(make_snapshot(tokens))
        pane.focus()
        await pilot.pause()
        cols = pane._grid.cols

        async def press(key: str) -> TokenBufferPane.Selected:
            count = len(app.selected)
            await pilot.press(key)
            await pilot.pause()
            assert len(app.selected) == count + 1, key
            return app.selected[-1]

        message = await press("end")
        assert (message.index, message.token) == (49, tokens[49])
        assert message.control is pane
        assert (await press("left")).index == 48
        assert (await press("home")).token == tokens[0]
        assert (await press("right")).index == 1
        assert (await press("down")).index == 1 + cols
        assert (await press("up")).index == 1
        assert (await press("pagedown")).index == 49  # clamped to the last token
        assert pane.selected_index == 49

        # the selected token is drawn in the selection style and described in the subtitle
        row = 49 // cols
        selected_style = segment_for(pane, row, "w49").style
        assert selected_style != segment_for(pane, row, "w48").style
        assert (
            pane.border_subtitle == pane.describe(49) == "pos 59 · id 1049 · 'w49' · assistant · turn 1 · last forward"
        )

        # click on the third cell of the second row (region includes the 1-cell border)
        grid = pane._grid
        await pilot.click(TokenBufferPane, offset=(1 + grid.gutter + 2 * grid.cell + 1, 1 + 1))
        await pilot.pause()
        assert app.selected[-1].index == cols + 2
        assert app.selected[-1].token == tokens[cols + 2]
        assert pane.selected_index == cols + 2

        # select() clamps and posts; selecting the same index again posts nothing
        pane.select(1000)
        await pilot.pause()
        assert app.selected[-1].index == 49
        count = len(app.selected)
        pane.select(49)
        await pilot.pause()
        assert len(app.selected) == count
        pane.select(None)
        assert pane.selected_index is None and pane.border_subtitle == ""


async def test_auto_follow_tail():
    app = Host()
    async with app.run_test(size=SIZE) as pilot:
        pane = app.query_one(TokenBufferPane)
        items = make_tokens(3000)
        pane.show(make_snapshot(TokenBuffer(items, 2000)))
        await pilot.pause()
        assert pane.scroll_offset.y == pane.max_scroll_y > 0  # no selection: follow the tail
        assert any("w1999" in line for line in lines(pane))

        pane.select(10)  # a selection away from the end pins the view
        await pilot.pause()
        assert pane.scroll_offset.y <= 10 // pane._grid.cols
        pane.show(make_snapshot(TokenBuffer(items, 2100)))
        await pilot.pause()
        assert pane.selected_index == 10
        assert any("w10" in line for line in lines(pane))

        pane.select(2099)  # a selection on the last token follows it
        await pilot.pause()
        pane.show(make_snapshot(TokenBuffer(items, 2500)))
        await pilot.pause()
        assert pane.selected_index == 2499
        assert app.selected[-1].index == 2499
        assert pane.scroll_offset.y == pane.max_scroll_y
        assert any("w2499" in line for line in lines(pane))


async def test_new_rows_scroll_without_a_screen_layout():
    """A growing buffer changes the pane's scroll range only: the scrollbar and the tail follow it, and the
    screen is not laid out again (on 2 cores that pass is CPU taken from the model)."""
    app = Host()
    async with app.run_test(size=SIZE) as pilot:
        pane = app.query_one(TokenBufferPane)
        items = make_tokens(3000)
        pane.show(make_snapshot(TokenBuffer(items, 500)))
        await pilot.pause()
        layouts = []
        refresh_layout = app.screen._refresh_layout
        app.screen._refresh_layout = lambda *a, **k: (layouts.append(k.get("scroll", False)), refresh_layout(*a, **k))
        for count in (620, 900, 2400):
            pane.show(make_snapshot(TokenBuffer(items, count)))
            await pilot.pause()
            rows = -(-(count + 1) // pane._grid.cols)  # every token and the cursor cell
            assert pane.virtual_size.height == rows == pane.vertical_scrollbar.window_virtual_size
            assert pane.scroll_offset.y == pane.max_scroll_y == rows - pane.scrollable_content_region.height
            assert any(f"w{count - 1}" in line for line in lines(pane))
        assert all(layouts), f"screen-wide layout passes: {layouts.count(False)}"


# ---------------------------------------------------------------- scale and rewind


async def test_hundred_thousand_tokens_render_only_what_is_visible():
    app = Host()
    async with app.run_test(size=SIZE) as pilot:
        pane = app.query_one(TokenBufferPane)
        buffer = CountingBuffer(make_tokens(100_000))
        snapshot = make_snapshot(buffer, fed=1)
        buffer.reads = 0
        pane.show(snapshot)
        await pilot.pause()
        rendered = lines(pane)
        assert buffer.reads < 5_000, buffer.reads
        # followed the tail: the last token, its position and the cursor cell are on screen
        assert pane.scroll_offset.y == pane.max_scroll_y
        assert any("w99999" in line for line in rendered)
        assert "▌Hi" in rendered[-1] or any("▌Hi" in line for line in rendered)
        cols = pane._grid.cols
        last_row_start = (100_000 // cols) * cols
        assert any(line.lstrip().startswith(str(last_row_start)) for line in rendered)

        # scrolling to the top renders the first positions, again reading only a screenful
        buffer.reads = 0
        pane.scroll_home(animate=False, immediate=True)
        await pilot.pause()
        rendered = lines(pane)
        assert rendered[0].lstrip().startswith("0 ") and "w0" in rendered[0]
        assert buffer.reads < 5_000, buffer.reads

        buffer.reads = 0
        pane.select(50_000)
        await pilot.pause()
        assert any("w50000" in line for line in lines(pane))
        assert buffer.reads < 5_000, buffer.reads
        assert app.selected[-1].token.position == 50_000


async def test_rewind_to_a_shorter_buffer():
    app = Host()
    async with app.run_test(size=SIZE) as pilot:
        pane = app.query_one(TokenBufferPane)
        pane.show(make_snapshot(make_tokens(2000), fed=1))
        pane.select(1500)
        await pilot.pause()
        cols = pane._grid.cols

        rewound = make_tokens(20, prefix="r")
        pane.show(make_snapshot(rewound, fed=20, chosen="next"))
        await pilot.pause()
        assert pane.virtual_size.height == -(-21 // cols)
        assert pane.scroll_offset.y == 0
        rendered = lines(pane)
        assert "r0" in rendered[0] and rendered[0].lstrip().startswith("0 ")
        assert "r19" in rendered[19 // cols]
        assert "▌next" in rendered[20 // cols]
        assert all(line.strip() == "" for line in rendered[20 // cols + 1 :])
        assert not any("w" in line for line in rendered)
        # the selection was past the new end: it moves to the last token that still exists
        assert pane.selected_index == 19
        assert app.selected[-1].index == 19 and app.selected[-1].token == rewound[19]
        # a rewind's re-prefill highlights the whole new buffer as the last forward
        assert segment_for(pane, 0, "r0").style == segment_for(pane, 0, "r1").style


async def test_show_before_mount_and_resize_reflow():
    class Early(Host):
        def compose(self) -> ComposeResult:
            pane = TokenBufferPane()
            pane.show(make_snapshot(make_tokens(5000)))  # before the pane has a size
            yield pane

    app = Early()
    async with app.run_test(size=SIZE) as pilot:
        pane = app.query_one(TokenBufferPane)
        await pilot.pause()
        wide_cols = pane._grid.cols
        assert pane.scroll_offset.y == pane.max_scroll_y > 0
        assert "▌Hi" in lines(pane)[-1]

        await pilot.resize_terminal(60, 20)  # fewer tokens per row, more rows, still at the tail
        await pilot.pause()
        assert pane._grid.cols < wide_cols
        assert pane.virtual_size.height == -(-5001 // pane._grid.cols)
        assert pane.scroll_offset.y == pane.max_scroll_y
        assert "▌Hi" in lines(pane)[-1]

        pane.select(100)  # a selection stays in view across a resize
        await pilot.pause()
        await pilot.resize_terminal(100, 30)
        await pilot.pause()
        assert any("w100" in line for line in lines(pane))


async def test_show_buffer_without_a_snapshot():
    app = Host()
    async with app.run_test(size=SIZE) as pilot:
        pane = app.query_one(TokenBufferPane)
        tokens = make_tokens(12)
        pane.show_buffer(
            TokenBuffer(tokens),
            last_forward_count=2,
            pending_text="zz",
            layers=(layer(0, kind="sliding", window=4, seen=12, held_from=8),),
        )
        pane.selected_layer = 0
        await pilot.pause()
        text = " ".join(lines(pane))
        assert "w0" in text and "w11" in text and "▌zz" in text
        assert segment_for(pane, 0, "w7").style.strike and not segment_for(pane, 0, "w8").style.strike
        assert "next pos 12" in pane.border_title


async def test_special_tokens_are_never_cut_even_far_from_the_tail():
    """The newest tokens are scanned at show (O(SCAN_NEW)); an older special token widens the grid when its row
    is drawn, so on screen it is whole; a reset narrows the grid back."""
    from kvtui.widgets.step.token_buffer import SCAN_NEW

    app = Host()
    async with app.run_test(size=SIZE) as pilot:
        pane = app.query_one(TokenBufferPane)
        header = BufferToken(0, 9, "<|start_header_id|>", True, "template", 1)
        tokens = [header, *make_tokens(SCAN_NEW + 500, start_position=1)]
        buffer = CountingBuffer(tokens)
        pane.show(make_snapshot(buffer))
        await pilot.pause()
        assert buffer.reads < 5_000 and pane._grid.cell == pane.cell_width  # not seen yet: ordinary cells
        pane.scroll_home(animate=False, immediate=True)
        await pilot.pause()
        lines(pane)  # drawn: the row holding it widens the grid
        await pilot.pause()
        assert pane._grid.cell == len("<|start_header_id|>") + 1
        assert "<|start_header_id|>" in lines(pane)[0]
        pane.show(make_snapshot([]))
        await pilot.pause()
        pane.show(make_snapshot(make_tokens(3)))
        await pilot.pause()
        assert pane._grid.cell == pane.cell_width

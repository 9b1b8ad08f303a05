"""Every screen whole at 80×24 and 120×36 (issue 52): what each pane shows at the two sizes a user tried.

The status line keeps its numbers whole and the model's description as far as it fits, with the state (mode,
running, paused, ended) always in its badge; a watched program's output wraps; the layers pane keeps its fill
column when F5 and F6 show it on a short terminal; `X` leaves no reuse meter of the old conversation; `q`
quits at start-up; help renders its notes; the requests pane keeps its blocks column; kvtui's own line breaks
are not escaped; the server view names the selected block's token range.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import replace

import pytest
from textual.containers import VerticalScroll
from textual.widgets import Input

from kvtui import viewers
from kvtui.engine.server.server_trace import load_server_trace
from kvtui.fmt import size as size_text
from kvtui.widgets.step.chat_pane import ChatPane, program_step_text
from kvtui.widgets.step.layers_pane import LayersPane, format_filled
from kvtui.widgets.step.program_output import ProgramOutput
from kvtui.widgets.step.requests_pane import RequestsPane, format_blocks
from kvtui.widgets.step.token_buffer import TokenBufferPane
from pilot_helpers import start, wait_for, wait_idle
from request_snapshots import steps
from test_attach_app import SAMPLE
from test_layout import make_app, one_turn, screen_text
from test_requests_pane import PostedSteps, SilentSource, post

SIZES = [(80, 24), (120, 36)]
IDS = [f"{w}x{h}" for w, h in SIZES]


def region_text(app, widget) -> str:
    """The screen's text inside `widget`'s region, its lines joined by spaces (borders left out)."""
    region = widget.region
    lines = screen_text(app).splitlines()[region.y : region.y + region.height]
    return " ".join(" ".join(line[region.x : region.x + region.width] for line in lines).replace("│", " ").split())


def status_line(app) -> str:
    return screen_text(app).splitlines()[-2]  # above the footer


# ---- the status line ---------------------------------------------------------------------------------


def test_fit_line_keeps_numbers_whole_and_drops_the_description_from_its_end():
    from kvtui.widgets.shared.status_bar import fit_line  # here: the other tests also run on older code

    numbers = ["500.0 tok/s", "step 1.0 ms", "cache 21.5 KiB"]
    description = "m · cpu · float32 · dynamic cache · greedy · Qwen2ForCausalLM"
    whole = fit_line(numbers, description, None)
    assert whole == "500.0 tok/s │ step 1.0 ms │ cache 21.5 KiB │ " + description
    assert fit_line(numbers, description, len(whole)) == whole
    cut = fit_line(numbers, description, len(whole) - 1)
    assert cut.endswith("greedy · …") and "Qwen2" not in cut
    # narrower: fewer parts, always whole ones, always the numbers
    for width in range(len(fit_line(numbers, "m · cpu", 1e9)) + 2, len(whole)):  # room for one part and "…"
        line = fit_line(numbers, description, width)
        assert line.startswith("500.0 tok/s │ step 1.0 ms │ cache 21.5 KiB │ ")
        kept = line.removeprefix("500.0 tok/s │ step 1.0 ms │ cache 21.5 KiB │ ").split(" · ")
        assert all(part in description.split(" · ") for part in kept if part != "…"), line
    # too narrow for every number: the last ones drop whole
    assert fit_line(numbers, description, 30) == "500.0 tok/s │ step 1.0 ms │ …"


@pytest.mark.parametrize("size", SIZES, ids=IDS)
async def test_the_status_line_keeps_its_numbers_and_says_the_model(tiny_loaded, size):
    app = make_app(tiny_loaded)
    async with app.run_test(size=size) as pilot:
        await one_turn(pilot)
        line = status_line(app)
        snapshot = app.view.latest
        assert line.lstrip().startswith("run mode "), line  # the state, first
        assert re.search(r"\d+\.\d tok/s", line) and f"step {snapshot.forward_ms:.1f} ms" in line, line
        assert f"cache {size_text(snapshot.cache_bytes)}" in line, line  # the cache bytes, never cut
        assert "tiny-qwen2" in line, line
        if size[0] >= 120:  # the model, device, dtype, cache kind and sampler
            for part in ("cpu", "float32", "dynamic cache", "greedy"):
                assert part in line, (part, line)


async def test_the_state_badge_says_paused_then_the_mode(tiny_loaded):
    app = make_app(tiny_loaded)
    async with app.run_test(size=(80, 24)) as pilot:
        await start(pilot, app)  # step mode: only the prefill ran, the turn waits for space or r
        assert status_line(app).lstrip().startswith("step mode · paused"), status_line(app)
        app.query_one(TokenBufferPane).focus()
        await pilot.press("r")
        await wait_for(pilot, lambda: app.view.latest.turn_done, what="the turn")
        await wait_idle(pilot, app)
        assert status_line(app).lstrip().startswith("step mode "), status_line(app)
        assert "paused" not in status_line(app)


# ---- a watched program's output ------------------------------------------------------------------------

REPLY = "bot> Hello, welcome to the cache inspector: every token you send is kept in the cache"
LOADING = "Loading checkpoint shards: 100% done in three seconds"


@pytest.mark.parametrize("size", SIZES, ids=IDS)
async def test_a_program_s_output_wraps(tmp_path, size):
    script = tmp_path / "talk.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        print({REPLY!r})
        sys.stderr.write({LOADING!r} + "\\n")
        sys.stdout.write("you> "); sys.stdout.flush()
        sys.stdin.readline()
    """)
    )
    app = viewers.watch(str(script), [])
    async with app.run_test(size=size) as pilot:
        output = app.query_one(ProgramOutput)
        await wait_for(pilot, lambda: output.partial.get("stdout") == "you> ", 30, "the prompt")
        await pilot.pause(0.2)
        assert output.region.width < len(REPLY)  # the pane is narrower than the line: it wraps, whole
        shown = region_text(app, output)
        assert REPLY in shown and f"stderr {LOADING}" in shown.replace("stderr│", "stderr"), shown
        assert shown.index("you>") > shown.index(LOADING), shown  # the pending prompt under the lines
        await pilot.resize_terminal(size[0] + 30, size[1])  # wrapped again at the new width
        await pilot.pause(0.3)
        assert REPLY in region_text(app, output)
        app.view.driver.source.write_stdin("\n")
        await pilot.press("q")


# ---- the layers pane, the reuse meter, the keys at start-up, help ----------------------------------------


async def test_layers_keep_their_fill_column_with_f5_and_f6_at_80x24(tiny_loaded):
    app = make_app(tiny_loaded)
    async with app.run_test(size=(80, 24)) as pilot:
        await one_turn(pilot)
        app.query_one(TokenBufferPane).focus()
        await pilot.press("f5", "f6")
        await pilot.pause(0.3)
        pane = app.query_one(LayersPane)
        assert pane.display
        layer = app.view.latest.layers[0]
        shown = region_text(app, pane)
        assert "fill" in shown and format_filled(layer.filled, layer.capacity) in shown, shown
        assert "K·V" in shown and "kind" in shown, shown  # the README's narrow set: #, K·V, kind, fill


@pytest.mark.parametrize("size", SIZES, ids=IDS)
async def test_reset_leaves_nothing_of_the_old_conversation(tiny_loaded, size):
    app = make_app(tiny_loaded)
    async with app.run_test(size=size) as pilot:
        await one_turn(pilot)
        reuse = app.query_one("#reuse")
        assert "reused" in str(reuse.content)
        app.query_one(TokenBufferPane).focus()
        await pilot.press("X")
        await wait_for(pilot, lambda: app.view.latest is None, what="the reset")
        await wait_idle(pilot, app)
        assert str(reuse.content) == ""
        assert "tok/s" not in status_line(app) and "reused" not in screen_text(app)
        assert app.view.driver.meter.prefill is None and app.view.driver.meter.last_verify is None


async def test_q_at_start_up_quits_and_enter_moves_to_the_input(tiny_loaded):
    app = make_app(tiny_loaded)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("enter")  # the panes hold the keys; Enter goes to the input
        chat_input = app.query_one("#message", Input)
        assert app.focused is chat_input
        await pilot.press("q")
        assert chat_input.value == "q" and app.is_running  # typed, in the input
    app = make_app(tiny_loaded)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("q")  # at once, before anything else: the quit key
        await wait_for(pilot, lambda: not app.is_running, 30, "the app to quit")
        assert app.query_one("#message", Input).value == ""


@pytest.mark.parametrize("size", SIZES, ids=IDS)
async def test_help_renders_its_notes(tiny_loaded, size):
    app = make_app(tiny_loaded)
    async with app.run_test(size=size) as pilot:
        await pilot.press("question_mark")
        await pilot.pause(0.5)
        scroll = app.screen.query_one(VerticalScroll)
        seen = []
        while True:  # every page of help, as a person scrolls through it
            seen.append(screen_text(app))
            if scroll.scroll_y >= scroll.max_scroll_y:
                break
            scroll.scroll_page_down(animate=False)
            await pilot.pause(0.1)
        text = " ".join(seen)
        assert "3×125×64" in text and "`" not in text, text  # the notes' code spans, rendered


# ---- a watched server: the requests pane and the reuse line ----------------------------------------------


@pytest.mark.parametrize("size", SIZES, ids=IDS)
async def test_the_requests_pane_keeps_its_blocks_column(size):
    app = viewers.steps(PostedSteps(source=SilentSource(), title="transformers serve --continuous-batching"))
    async with app.run_test(size=size) as pilot:
        snapshot = steps()[1]
        await post(pilot, snapshot)
        pane = app.query_one(RequestsPane)
        header = [str(column.label) for column in pane.table.columns.values()]
        assert "blocks" in header, header
        shown = region_text(app, pane)
        for request in snapshot.requests:
            assert format_blocks(request.blocks) in shown, (request.request_id, shown)


class ProgramLine(PostedSteps):
    """A watched program's reuse line as the program driver writes it."""

    def reuse_text(self, snapshot):
        return program_step_text(snapshot)


@pytest.mark.parametrize("size", SIZES, ids=IDS)
async def test_kvtui_s_own_line_breaks_are_not_escaped_the_program_s_are(size):
    app = viewers.steps(ProgramLine(source=SilentSource(), title="prog.py"))
    async with app.run_test(size=size) as pilot:
        snapshot = replace(
            steps()[1],
            phase="prefill",
            turn=2,
            cache_length_before=0,
            requested_cache_position=(0,),
            caller="prog\n.py:12",  # the program's own text: a line break in it is shown escaped
        )
        await post(pilot, snapshot)
        reuse = str(app.query_one(ChatPane).query_one("#reuse").content)
        assert "\nturn 2 of this cache" in reuse, reuse  # its own line
        assert "\\x0aturn" not in reuse and "prog\\x0a.py:12" in reuse, reuse


# ---- the server view ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES, ids=IDS)
async def test_the_server_view_names_the_selected_block_s_token_range(size):
    app = viewers.server(run=load_server_trace(SAMPLE))
    async with app.run_test(size=size) as pilot:
        await pilot.pause(0.2)
        await pilot.press("n")  # the first note's block
        await pilot.pause(0.2)
        info = app.query_one("BlockDetail").info
        assert info is not None
        detail = app.screen.query_one("#right")
        assert f"tokens {info.start}..{info.end}" in region_text(app, detail), screen_text(app)

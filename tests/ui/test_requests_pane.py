"""Continuous batching in the TUI: the requests pane lists every request (a lane) as it arrives and finishes,
picking one shows it in the cache, cursor and top-k panes, and the layers pane shows the paged cache's blocks.
Driven by hand-built steps (request_snapshots.py) posted to a watched program's app, as the watch step builder
will send them."""

from __future__ import annotations

import threading
from dataclasses import replace

from rich.console import Console

from kvtui import viewers
from kvtui.app import KvtuiApp
from kvtui.drivers.program import ProgramDriver
from kvtui.messages import SnapshotReady
from kvtui.widgets.step.cursor_pane import CursorPane, render_cursor
from kvtui.widgets.step.layers_pane import LayersPane, render_paged
from kvtui.widgets.step.requests_pane import (
    RequestsPane,
    describe_request,
    for_request,
    format_blocks,
    format_table,
    kept_requests,
    request_rows,
    short_id,
)
from kvtui.widgets.step.token_buffer import TokenBufferPane
from kvtui.widgets.step.topk_pane import TopKPane
from pilot_helpers import wait_for
from request_snapshots import steps
from test_layout import screen_text


def plain(text) -> str:
    console = Console(width=200, record=True, color_system=None, file=open("/dev/null", "w"))
    console.print(text)
    return console.export_text()


# ---- pure renders ---------------------------------------------------------------------------------


def test_block_tables_fold_runs():
    assert format_table((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"
    assert format_table(()) == ""
    assert format_blocks((("full", (0, 1, 3)),)) == "3 [0-1,3]"
    assert format_blocks((("full", (0, 1)), ("sliding", (4,)))) == "full 2 [0-1] · sliding 1 [4]"
    assert format_blocks((("full", tuple(range(0, 60, 2))),)).endswith("…")


def test_request_rows_show_each_lane():
    first = steps()[0]
    rows = request_rows(first.requests)
    assert [row.request_id for row in rows] == ["req-a1", "req-b2", "req-c3"]
    cells = [[cell.plain for cell in row.cells] for row in rows]
    assert cells[0][:5] == ["req-a1", "prefilling", "prefill", "16/16", "16+0"]
    assert cells[1][5] == "8" and cells[1][8] == "1"  # b2 found the shared system block: 8 tokens, 1 block shared
    assert cells[2][1:4] == ["waiting", "-", "0/0"]
    second = request_rows(steps()[1].requests)
    assert [cell.plain for cell in second[2].cells][6] == "3"  # c3 recomputed 3 prompt tokens


def test_finished_requests_are_kept_below_the_live_ones():
    snapshots = steps()
    departed = kept_requests(snapshots[2].requests, snapshots[3].requests)
    assert [r.request_id for r in departed] == ["req-a1"] and departed[0].status == "finished"
    rows = request_rows(snapshots[3].requests, departed)
    assert [row.request_id for row in rows] == ["req-b2", "req-c3", "req-a1"]
    assert "dim" in str(rows[-1].cells[0].style)


def test_a_request_that_left_unseen_is_not_shown_still_decoding():
    """An idle server makes no forward after its last requests finish: one last seen decoding that is no longer
    live is shown as having left, not as decoding (the same holds for one evicted without a word)."""
    snapshots = steps()
    decoding = [r for r in snapshots[2].requests if r.status == "decoding"]
    assert decoding
    departed = kept_requests(tuple(decoding), ())
    assert [r.status for r in departed] == ["left"] * len(decoding) and all(r.phase == "" for r in departed)
    assert kept_requests(tuple(decoding), tuple(decoding)) == ()  # still live: not departed


def test_a_request_that_finished_between_repaints_is_listed_as_it_ended():
    """The app sees every step, the pane only the painted ones: a request painted waiting that finished in steps
    no repaint showed is listed with its last view (finished, its tokens), not as the painted step saw it."""
    from dataclasses import replace

    snapshots = steps()
    painted = snapshots[2].requests
    (waiting,) = [r for r in painted if r.request_id == "req-a1"][:1]
    ended = replace(waiting, status="finished", phase="", held=waiting.held + 5, generated=waiting.generated + 5)
    live = tuple(r for r in snapshots[3].requests if r.request_id != "req-a1")
    departed = kept_requests(painted, live, latest={"req-a1": ended})
    assert [r for r in departed if r.request_id == "req-a1"] == [ended]
    assert [r for r in kept_requests(painted, live) if r.request_id == "req-a1"][0] != ended  # without: the painted


def test_for_request_is_the_row_that_fed_it():
    second = steps()[1]
    c3 = for_request(second, "req-c3")
    assert c3.row == 2 and [t.piece for t in c3.buffer][-1] == "\n" and c3.topk[0].text == " 1"
    waiting = for_request(steps()[0], "req-c3")  # not fed in step 1: nothing of another request or step
    assert len(waiting.buffer) == 0 and waiting.topk == () and waiting.input_ids == ()


def test_cursor_pane_names_the_request_or_says_it_was_not_fed():
    first = steps()[0]
    b2 = first.requests[1]
    line = describe_request(b2, "req-b2", True, 1)
    text = plain(render_cursor(for_request(first, "req-b2"), request=line))
    assert "request req-b2 · prefilling · prefill · fed 8 · holds 16 (prompt 16 + 0) · hit 8" in text
    assert "blocks 2 [0,2] (1 shared)" in text
    waiting = plain(describe_request(first.requests[2], "req-c3", False, 1))
    assert "req-c3 · waiting · not fed in step 1" in waiting
    gone = plain(describe_request(None, "req-a1", False, 4))
    assert "not live at step 4" in gone


def test_paged_groups_in_the_layers_pane():
    text = plain(render_paged(steps()[1].paged))
    assert "6 used (1 shared) · 0 cached · 10 free of 16 × 8 tok · 2 layers" in text
    full = plain(render_paged(steps()[3].paged))
    assert "5 used · 2 cached · 9 free of 16" in full


# ---- the app ---------------------------------------------------------------------------------------


class SilentSource:
    """A watched server that sends nothing by itself: the test posts its steps."""

    supports = ("pause", "step", "run", "verify", "watch", "break")

    def records(self, stop: threading.Event):
        stop.wait()
        return iter(())

    def command(self, word, argument=None) -> None:
        pass

    def stop(self) -> None:
        pass


class PostedSteps(ProgramDriver):
    """A program driver whose steps the test posts (the codec does not carry requests yet)."""

    def reuse_text(self, snapshot):
        return f"step {snapshot.step} · {len(snapshot.requests or ())} requests"


def make_app() -> KvtuiApp:
    return viewers.steps(PostedSteps(source=SilentSource(), title="transformers serve --continuous-batching"))


async def post(pilot, snapshot) -> None:
    app = pilot.app
    app.view.post_message(SnapshotReady(snapshot, None, (), running=False))
    await wait_for(pilot, lambda: app.query_one(RequestsPane)._snapshot is snapshot, what=f"step {snapshot.step}")
    await pilot.pause(0.05)


def buffer_pieces(app) -> list[str]:
    shown = app.query_one(TokenBufferPane).snapshot
    return [t.piece for t in shown.buffer] if shown is not None else []


async def test_requests_arrive_finish_and_one_picked_shows_in_the_panes():
    snapshots = steps()
    app = make_app()
    async with app.run_test(size=(160, 48)) as pilot:
        pane = app.query_one(RequestsPane)
        assert not pane.display  # no packed step yet: no requests pane
        await post(pilot, snapshots[0])
        assert pane.display and pane.request_ids == ["req-a1", "req-b2", "req-c3"]
        text = screen_text(app)
        assert "req-c3" in text and "waiting" in text and "3 used (1 shared)" in text
        assert "cache 3/16 blocks" in text and "cache 0 B" not in text  # a paged cache: its blocks, not 0 bytes
        assert buffer_pieces(app)[-3:] == [" fruit", "<|im_end|>", "\n"]  # row 0: req-a1

        await pilot.press("n")  # the next request: b2, its tokens and its top-k
        assert pane.selected_request == "req-b2"
        assert buffer_pieces(app)[-3:] == [" colour", "<|im_end|>", "\n"]
        assert app.query_one(TopKPane)._rows[0].token.text == " Blue"
        assert "request req-b2 · prefilling" in plain(app.query_one(CursorPane).content)

        await pilot.press("n")  # c3 waits: not fed in step 1
        assert pane.selected_request == "req-c3" and buffer_pieces(app) == []
        assert "not fed in step 1" in plain(app.query_one(CursorPane).content)

        await post(pilot, snapshots[1])  # c3 prefills now: the same pick follows it
        assert buffer_pieces(app)[-3:] == [" three", "<|im_end|>", "\n"]
        assert "recomputed 3" in plain(app.query_one(CursorPane).content)

        await post(pilot, snapshots[2])
        assert "finished" in screen_text(app)
        await post(pilot, snapshots[3])  # a1 left the live list: kept below, dimmed
        assert pane.request_ids == ["req-b2", "req-c3", "req-a1"]
        assert app.query_one(RequestsPane).table.cursor_row == 1  # still on c3 while rows moved

        pane.table.focus()  # arrows pick too
        await pilot.press("up")
        assert pane.selected_request == "req-b2"
        assert buffer_pieces(app)[-3:] == [" Blue", ".", "<|im_end|>"]
        assert "5 used · 2 cached" in screen_text(app)

        await pilot.click("#requests-table", offset=(3, 2))  # a click on the second row: c3
        await wait_for(pilot, lambda: pane.selected_request == "req-c3", what="the clicked request")
        assert buffer_pieces(app)[-2:] == [" 1", " 2"]
        await pilot.click("#requests-table", offset=(3, 3))  # a1 has finished and left: nothing of it to show
        await wait_for(pilot, lambda: pane.selected_request == "req-a1", what="the departed request")
        assert buffer_pieces(app) == [] and "not live at step 4" in plain(app.query_one(CursorPane).content)


async def test_requests_pane_fits_small_terminals_and_folds_away():
    app = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await post(pilot, steps()[1])
        text = screen_text(app)
        assert "req-a1" in text and "req-c3" in text
        assert app.query_one(TokenBufferPane).region.height >= 5
        await pilot.press("f7")
        assert not app.query_one(RequestsPane).display
        await pilot.press("f7")
        assert app.query_one(RequestsPane).display
    assert LayersPane  # the layers pane's paged view is checked on screen in the test above


async def test_a_server_s_long_request_ids_are_short_in_the_list_and_whole_when_selected():
    """A server's 36-character ids would push the hit and recomputed columns off an 80-column screen: the list
    shows each id's head and tail, the cursor pane the selected one in full."""
    uuids = {
        "req-a1": "chatcmpl-6f1c2d9e-0b7a-4c55-9e1f-3a8d2c7b91a1",
        "req-b2": "chatcmpl-6f1c2d9e-0b7a-4c55-9e1f-77e0d4c2b3f8",
    }

    def renamed(snapshot):
        requests = tuple(replace(r, request_id=uuids.get(r.request_id, r.request_id)) for r in snapshot.requests)
        rows = tuple(replace(row, request_id=uuids.get(row.request_id, row.request_id)) for row in snapshot.rows)
        return replace(snapshot, requests=requests, rows=rows)

    assert short_id(uuids["req-a1"]) == "chatc…91a1" and short_id("req-a1") == "req-a1"
    app = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await post(pilot, renamed(steps()[1]))
        pane = app.query_one(RequestsPane)
        text = screen_text(app)
        assert "chatc…91a1" in text and "chatc…b3f8" in text and uuids["req-a1"] not in text
        header = [str(column.label) for column in pane.table.columns.values()]
        assert {"request", "status", "phase", "fed/held", "hit", "recomp"} <= set(header), header
        pane.select_request(uuids["req-b2"])
        await pilot.pause(0.1)
        assert uuids["req-b2"] in plain(app.query_one(CursorPane).content)  # selected: named in full


async def two_servers_steps(pilot) -> None:
    """The screen the README shows: step 2 of the hand-built server, request c3 picked (it recomputed 3 tokens)."""
    for snapshot in steps()[:2]:
        await post(pilot, snapshot)
    pilot.app.query_one(RequestsPane).select_request("req-c3")
    await pilot.pause(0.1)


def test_serving_screen(snap_compare):
    """Deterministic (hand-built steps): also the README's docs/serve.svg, written by
    `KVTUI_DOCS_SCREENSHOT=1 pytest tests/ui/test_requests_pane.py -k docs`."""
    assert snap_compare(make_app(), terminal_size=(120, 36), run_before=two_servers_steps)


async def test_docs_screenshot(tmp_path):
    import os
    from pathlib import Path

    app = make_app()
    async with app.run_test(size=(120, 36)) as pilot:
        await two_servers_steps(pilot)
        docs = Path(__file__).parents[2] / "docs"
        target = docs if os.environ.get("KVTUI_DOCS_SCREENSHOT") else tmp_path
        path = app.save_screenshot("serve.svg", str(target))
    assert "req-c3" in Path(path).read_text().replace("&#160;", " ")

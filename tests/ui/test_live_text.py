"""LiveText: new text on screen at once, a screen-wide layout pass only when its height changes."""

from __future__ import annotations

from textual.app import App, ComposeResult
from textual.containers import VerticalScroll

from kvtui.widgets.shared.live_text import LiveText


class Host(App):
    CSS = """
    #fixed { height: 1; }
    #column { width: 20; height: 1fr; }
    """

    def compose(self) -> ComposeResult:
        yield LiveText("header", id="fixed")
        with VerticalScroll(id="column"):
            yield LiveText("short", id="auto")
            yield LiveText("below", id="below")


def _layouts(app) -> list[int]:
    """Count the screen's layout passes from now on."""
    screen = app.screen
    count = [0]
    original = screen._refresh_layout

    def counting(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    screen._refresh_layout = counting
    return count


def _line(app, y: int) -> str:
    return "".join(segment.text for segment in app.screen._compositor.render_strips()[y]).rstrip()


async def test_same_height_updates_without_a_layout_pass_and_shows_the_new_text():
    app = Host()
    async with app.run_test(size=(40, 10)) as pilot:
        await pilot.pause()
        auto, fixed = app.query_one("#auto", LiveText), app.query_one("#fixed", LiveText)
        layouts = _layouts(app)
        assert auto.show_text("other") is False
        assert fixed.show_text("a header far longer than the forty cells of this screen") is False
        await pilot.pause()
        assert layouts[0] == 0
        assert _line(app, 0).startswith("a header far longer")
        assert _line(app, 1) == "other"
        assert _line(app, 2) == "below"


async def test_a_taller_text_lays_out_and_pushes_what_follows_down():
    app = Host()
    async with app.run_test(size=(40, 10)) as pilot:
        await pilot.pause()
        auto = app.query_one("#auto", LiveText)
        layouts = _layouts(app)
        # 20 cells wide: this wraps to three lines
        assert auto.show_text("one two three four five six seven eight nine ten eleven") is True
        await pilot.pause()
        assert layouts[0] >= 1
        assert auto.size.height == 3
        assert app.query_one("#below").region.y == 4  # the header's row, then three lines
        assert _line(app, 4) == "below"
        # and back to one line: the space is given back
        assert auto.show_text("short again") is True
        await pilot.pause()
        assert auto.size.height == 1
        assert _line(app, 2) == "below"

"""One app, three screens sharing one chrome: help built from the shown screen's bindings (keys written `?`,
`F1`; the source's own notes, no chat instructions on a watched program or a server), `t` cycles the themes,
`p` pauses what the screen follows, `q` stops it (never a server kvtui attached to), then the app."""

from __future__ import annotations

import io
import threading
from collections import deque
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console

from kvtui import viewers
from kvtui.app import KvtuiApp
from kvtui.engine.chat.script import Script
from kvtui.engine.server.prefix_cache import PrefixCache
from kvtui.engine.server.server_trace import load_server_trace
from kvtui.screens.compare import CompareScreen
from kvtui.widgets.shared.help_screen import HelpScreen
from pilot_helpers import wait_for
from test_layout import screen_text
from test_requests_pane import PostedSteps, SilentSource

SAMPLE = Path(__file__).resolve().parent.parent / "data" / "server_trace_sample.jsonl"
CHAT_WORDS = ("Send a message", "backspace to rewind", "to force that token")


class StubComparison:
    """The lockstep's face to the screen, without engines: it records pause and stop."""

    def __init__(self):
        self.lanes, self.turn, self.identical, self.on_update = [], 0, True, None
        self.paused: list[bool] = []
        self.stopped = threading.Event()

    def start(self):
        pass

    def run(self, turns):
        self.stopped.wait(30)

    def pause(self, paused: bool):
        self.paused.append(paused)

    def stop(self):
        self.stopped.set()

    def first_difference(self, final=True):
        return None


def live_server() -> tuple[KvtuiApp, list[str]]:
    stops: list[str] = []
    session = SimpleNamespace(
        cache=PrefixCache(), title="m at http://srv:8000", problems=deque(), error=None, stop=lambda: stops.append("x")
    )
    return viewers.server(session=session), stops


def apps() -> dict[str, KvtuiApp]:
    return {
        "watched server": viewers.steps(PostedSteps(source=SilentSource(), title="transformers serve")),
        "server view": live_server()[0],
        "server replay": viewers.server(run=load_server_trace(SAMPLE)),
        "compare": viewers.compare(
            None, ("dynamic",), {}, Path("."), Script(turns=("hi",)), comparison=StubComparison()
        ),
    }


async def help_text(pilot, app: KvtuiApp) -> str:
    await pilot.press("f1")
    await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), what="the help screen")
    await pilot.pause(0.05)
    console = Console(width=200, record=True, file=io.StringIO())
    for static in app.screen.query("Static"):
        console.print(static.content)
    text = " ".join(console.export_text().split())
    await pilot.press("escape")
    await wait_for(pilot, lambda: not isinstance(app.screen, HelpScreen), what="help closed")
    return text


async def test_every_screen_has_the_same_chrome_and_its_own_help():
    for name, app in apps().items():
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause(0.1)
            if name == "watched server":  # its cache pane before the first forward: in a program's words
                assert "no forward yet" in screen_text(app) and "send a message" not in screen_text(app)
            text = await help_text(pilot, app)
            assert "?, F1" in text and "question_mark" not in text, (name, text)
            assert "ctrl+q, q" in text and "quit" in text, name
            for words in CHAT_WORDS:
                assert words not in text, (name, words)  # kvtui's chat instructions belong to kvtui's chat only
            before = app.theme
            await pilot.press("t")
            await pilot.pause(0.05)
            assert app.theme != before, name  # one theme cycle on every screen
            assert app.screen is app.view


async def test_help_says_what_each_source_is():
    texts = {}
    for name, app in apps().items():
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause(0.1)
            texts[name] = await help_text(pilot, app)
    assert "A watched program computes as it would unwatched" in texts["watched server"]
    assert "kvtui only listens" in texts["server view"]
    assert "A server trace replayed" in texts["server replay"]
    assert "same greedy chat under each cache strategy" in texts["compare"]
    # a key the source cannot honour is listed dimmed with why: a replayed server trace has nothing to pause
    assert "nothing to pause" in texts["server replay"] and "nothing to pause" not in texts["server view"]


async def test_quit_stops_what_the_screen_follows():
    app, stops = live_server()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause(0.1)
        await pilot.press("q")
        await wait_for(pilot, lambda: bool(stops), what="the event reader stopped")
    assert stops  # the session's reader (the server itself is not kvtui's: nothing else is stopped)
    comparison = StubComparison()
    app = viewers.compare(None, ("dynamic",), {}, Path("."), Script(turns=("hi",)), comparison=comparison)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause(0.1)
        await pilot.press("p")
        await wait_for(pilot, lambda: comparison.paused == [True], what="the lockstep paused")
        assert "PAUSED" in screen_text(app)
        await pilot.press("p")
        await wait_for(pilot, lambda: comparison.paused == [True, False], what="the lockstep going on")
        await pilot.press("q")
        await wait_for(pilot, comparison.stopped.is_set, what="the engines stopped")
    assert isinstance(app.view, CompareScreen)

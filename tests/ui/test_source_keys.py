"""Keys that belong to their source: in a replay and in a watched program's stream, every key of kvtui's
own chat either works or is visibly disabled with its reason (dimmed in the footer, listed in help, said
when pressed), and a refused key never changes what the panes show.

The watched program is a fake source here (records in, commands out, no process), as memray's UI tests
pass a mock reader; tests/ui/test_watch_app.py keeps the real child end to end."""

from __future__ import annotations

import io
import json
import threading

import pytest
from rich.console import Console

from kvtui import viewers
from kvtui.app import KvtuiApp
from kvtui.engine.chat.session import ChatSession, SessionConfig
from kvtui.engine.records.codec import buffer_record, to_record
from kvtui.engine.records.stream import format_command
from kvtui.engine.records.trace import TraceWriter, header_record
from kvtui.widgets.shared.status_bar import StatusBar
from kvtui.widgets.step.token_buffer import TokenBufferPane
from pilot_helpers import wait_for

SIZE = (140, 45)


@pytest.fixture(scope="module")
def trace(tmp_path_factory, tiny_model):
    model, tok = tiny_model("qwen2")
    path = tmp_path_factory.mktemp("keys") / "chat.jsonl"
    session = ChatSession(model, tok, SessionConfig(max_new_tokens=4))
    with TraceWriter(path, header_record(session, "tiny-qwen2", "tiny")) as writer:
        session.on_snapshot.add(lambda snapshot: writer.write(to_record(snapshot)))
        session.send("What is k?")
        session.generate()
        writer.write(buffer_record(session.buffer))
    return path


class FakeProgram:
    """A watched program's stream without the program: the trace's records, then it waits (still running);
    commands are kept in order."""

    supports = ("pause", "step", "run", "verify", "watch", "break")

    def __init__(self, records: list[dict]):
        self._records = records
        self.sent: list[str] = []

    def records(self, stop: threading.Event):
        yield from self._records
        stop.wait()

    def command(self, word: str, argument=None) -> None:
        self.sent.append(format_command(word, argument))

    def stop(self) -> None:
        pass


def screen_facts(app):
    """What a refused key must leave as it was: the step shown, its buffer, and the alarms."""
    pane = app.query_one(TokenBufferPane)
    return (
        app.view.latest.step,
        pane.snapshot.buffer.ids() if pane.snapshot else None,
        len(app.view.diagnostics),
        app.view.pinned_step,
    )


# key -> what it does in a replay: "works" (a check follows), or the words its reason must contain
REPLAY_KEYS = {
    "v": "read-only",
    "o": "read-only",
    "R": "runs no engine",
    "e": "no K/V tensors",
    "f": "read-only",
    "w": "read-only",
    "m": "no model",
    "X": "read-only",
    "u": "works",
    "backspace": "works",
}
# the same keys on a watched program (observe only)
WATCH_KEYS = {
    "v": "works",
    "o": "samples on its own",
    "R": "no kvtui engine",
    "e": "not available",
    "f": "change the program",
    "m": "decides how it generates",
    "X": "change the program's cache",
    "u": "behind its back",
    "backspace": "behind its back",
    "space": "works",
    "b": "works",
}
ACTIONS = {
    "v": "verify",
    "o": "sampler",
    "R": "restart_engine",
    "e": "export_cache",
    "f": "force",
    "w": "watch",
    "m": "toggle_step_mode",
    "X": "reset",
    "u": "rewind",
    "backspace": "rewind_to",
    "space": "step",
    "r": "run",
    "p": "pause",
    "b": "break_on_alarm",
}


async def settled(app, pilot):
    """The panes once every record already read is painted: no repaint pending (a busy machine repaints at
    2 Hz), the buffer pane on the latest step, and two looks 0.15 s apart agree."""
    facts = None
    for _ in range(100):
        await pilot.pause(0.15)
        pane = app.query_one(TokenBufferPane)
        painted = app.view._paint_timer is None and (
            app.view.latest is None or (pane.snapshot and pane.snapshot.step == app.view.latest.step)
        )
        if painted and facts == (facts := screen_facts(app)):
            return facts
    raise AssertionError("the panes never settled")


async def press_and_check(app, pilot, key: str, expect: str) -> str | None:
    """Press one key; what went wrong (None: it did what `expect` says)."""
    action = ACTIONS[key]
    before = await settled(app, pilot)
    shown = {id(note) for note in app._notifications}  # older ones may expire meanwhile: not by count
    await pilot.press(key)
    await pilot.pause(0.15)
    said = [str(note.message) for note in app._notifications if id(note) not in shown]
    if expect == "works":
        return None if app.view.check_action(action, ()) is True else f"{key} ({action}): disabled"
    if app.view.check_action(action, ()) is not None:
        return f"{key} ({action}): not shown disabled"
    if not any(expect in text for text in said):
        return f"{key} ({action}): said {said}, not the reason ({expect!r})"
    if await settled(app, pilot) != before:
        return f"{key} ({action}): changed the panes"
    return None


def refused_first(keys: dict[str, str]) -> list[str]:
    """The refused keys, then those that work (they move the screen on)."""
    return [key for key in keys if keys[key] != "works"] + [key for key in keys if keys[key] == "works"]


async def test_every_key_in_a_replay_works_or_says_why_it_cannot(trace):
    app = viewers.replay(trace)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.latest is not None, what="the first recorded step")
        app.query_one(TokenBufferPane).focus()
        await pilot.press("r")  # play to the end: every pane filled
        await wait_for(
            pilot, lambda: app.view.driver.position == len(app.view.driver.replay) - 1, timeout=20, what="the last step"
        )
        # an alarm's "jump to step" finds the recorded step by its number
        assert app.view.driver.find_step(app.view.latest.step) is app.view.driver.replay.snapshots[-1]
        assert app.view.driver.find_step(-1) is None
        wrong = []
        for key in refused_first(REPLAY_KEYS):
            position = app.view.driver.position
            if key == "backspace":  # rewind to a selected token: select one first
                app.query_one(TokenBufferPane).select(2)
            wrong.append(await press_and_check(app, pilot, key, REPLAY_KEYS[key]))
            if REPLAY_KEYS[key] == "works":
                await wait_for(
                    pilot, lambda before=position: app.view.driver.position < before, what=f"a step back ({key})"
                )
                assert app.view.latest.step == app.view.driver.replay.snapshots[app.view.driver.position].step
        assert not [w for w in wrong if w], "\n".join(w for w in wrong if w)


async def test_help_lists_why_a_replay_key_is_disabled(trace):
    from kvtui.widgets.shared.help_screen import HelpScreen

    app = viewers.replay(trace)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.latest is not None, what="the first recorded step")
        await pilot.press("question_mark")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), what="the help screen")
        console = Console(width=200, record=True, file=io.StringIO())
        for static in app.screen.query("Static"):
            console.print(static.content)
        text = " ".join(console.export_text().split())
        assert "verify: not here (replay is read-only" in text
        assert "step: not here" not in text  # stepping through the recording works


def trace_records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_every_key_on_a_watched_program_works_or_says_why_it_cannot(trace):
    source = FakeProgram(trace_records(trace))
    app = viewers.watch(source=source, title="fake program")
    async with app.run_test(size=SIZE) as pilot:
        steps = sum(1 for r in source._records if r["type"] == "step")
        await wait_for(
            pilot, lambda: app.view.latest is not None and len(app.view.driver.replay) == steps, what="every step"
        )
        app.query_one(TokenBufferPane).focus()
        app.query_one(TokenBufferPane).select(2)
        wrong = []
        for key in refused_first(WATCH_KEYS):
            sent = len(source.sent)
            wrong.append(await press_and_check(app, pilot, key, WATCH_KEYS[key]))
            if WATCH_KEYS[key] == "works":
                expected = {"v": "verify", "space": "step", "b": 'break "on"'}[key]
                if source.sent[sent:][-1:] != [expected]:
                    wrong.append(f"{key}: sent {source.sent[sent:]}, not {expected!r}")
            elif source.sent[sent:]:
                wrong.append(f"{key}: sent {source.sent[sent:]} to the program")
        assert not [w for w in wrong if w], "\n".join(w for w in wrong if w)


async def test_every_key_on_a_followed_trace_works_or_says_why_it_cannot(trace):
    """replay --follow is replay: the same keys, the same reasons."""
    app = viewers.replay(trace, follow=True)
    async with app.run_test(size=SIZE) as pilot:
        steps = sum(1 for r in trace_records(trace) if r["type"] == "step")
        await wait_for(pilot, lambda: app.view.latest is not None and app.view.latest.step == steps, 30, "every step")
        app.query_one(TokenBufferPane).focus()
        wrong = []
        for key in refused_first(REPLAY_KEYS):
            position = app.view.driver.position
            if key == "backspace":
                app.query_one(TokenBufferPane).select(2)
            wrong.append(await press_and_check(app, pilot, key, REPLAY_KEYS[key]))
            if REPLAY_KEYS[key] == "works":
                await wait_for(
                    pilot, lambda before=position: app.view.driver.position < before, what=f"a step back ({key})"
                )
        assert not [w for w in wrong if w], "\n".join(w for w in wrong if w)


@pytest.fixture(scope="module")
def watched_trace(tmp_path_factory, tiny_model):
    """A watched program's trace: a prefill and three decode steps of a hand-written loop, a copied cache."""
    import copy

    import torch
    from transformers import DynamicCache

    from kvtui.engine.watch.probe import watch

    model, tok = tiny_model("llama")
    path = tmp_path_factory.mktemp("keys") / "watched.jsonl"
    watcher = watch(model, tok, trace=path)
    try:
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            ids = torch.tensor([[5, 6, 7, 8]])
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            for _ in range(3):
                ids = out.logits[:, -1:].argmax(-1)
                out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            copied = copy.deepcopy(cache)  # a second cache, copied from the first
            model(input_ids=ids, past_key_values=copied, use_cache=True)
    finally:
        watcher.detach()
    return path


@pytest.fixture(scope="module")
def program_trace(tmp_path_factory):
    """A sample program's trace recorded as a user records it (`kvtui watch --headless --trace`): a
    hand-written decode loop on SmolLM2 whose earlier steps show wider ids and probabilities in the top-k
    table than its last, so a replay played through them and one opened caught up reach the last step by
    different paths."""
    import subprocess
    import sys
    from pathlib import Path

    from kvtui.engine.chat.loader import embedded_model_dir

    root = Path(__file__).resolve().parents[2]
    path = tmp_path_factory.mktemp("keys") / "program.jsonl"
    program = root / "samples" / "programs" / "correct_loop.py"
    command = [sys.executable, "-m", "kvtui.cli", "watch", "--headless", "--trace", str(path), str(program)]
    result = subprocess.run([*command, str(embedded_model_dir())], capture_output=True, text=True, cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    return path


@pytest.mark.parametrize("which", ["chat", "watched", "program"])
async def test_replay_and_follow_of_a_finished_trace_draw_the_same_screen(trace, watched_trace, program_trace, which):
    """kvtui replay T (played to its end) and kvtui replay --follow T (caught up): the same SVG but for the
    status line's state badge, which says which of the two it is."""
    path = {"chat": trace, "watched": watched_trace, "program": program_trace}[which]
    steps = sum(1 for r in trace_records(path) if r["type"] == "step")
    screens, states = [], []
    for follow in (False, True):
        app = viewers.replay(path, follow=follow)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda app=app: app.view.latest is not None, 30, "the first step")
            if not follow:
                await pilot.press("r")
            await wait_for(
                pilot,
                lambda app=app: len(app.view.driver.replay) == steps and app.view.driver.position == steps - 1,
                30,
                "the last step",
            )
            await settled(app, pilot)
            app.clear_notifications()
            states.append(str(app.query_one("#status-state").content))
            app.query_one(StatusBar).set_state("")  # the one difference, by design: compared below
            await pilot.pause(0.2)
            screens.append(app.export_screenshot())
            reuse = app.query_one("#reuse").content.plain
            assert "at None" not in reuse
            if which != "chat":
                assert reuse.startswith(f"step {steps} at ")  # where the program's forward came from
                held = app.view.messages[0]  # the text the shown step's cache holds (the copy: 5 tokens)
                assert held["role"].endswith(" holds") and len(held["content"]) > 0
                assert held["content"] == "".join(t.piece for t in app.view.latest.buffer)
            else:
                assert app.view.messages, "no transcript"
    assert states == ["replay · end", "replay · following"]
    assert screens[0] == screens[1]


def test_one_app_class_every_source_an_argument():
    """The three sources are arguments of one KvtuiApp, not subclasses overriding its private methods."""
    import importlib
    import pkgutil

    import kvtui

    for module in pkgutil.walk_packages(kvtui.__path__, "kvtui."):
        if not module.name.startswith(("kvtui.data", "kvtui.engine")):
            importlib.import_module(module.name)
    assert KvtuiApp.__subclasses__() == []
    from textual.app import App

    apps = {cls for cls in _all_subclasses(App) if cls.__module__.startswith("kvtui.")}
    assert apps == {KvtuiApp}  # one app for every front end: the step viewer, the server view, compare are screens
    from kvtui.drivers.chat import ChatDriver
    from kvtui.drivers.program import ProgramDriver
    from kvtui.drivers.trace import TraceDriver

    assert {type(viewers.chat().view.driver), type(viewers.watch("x.py").view.driver)} == {ChatDriver, ProgramDriver}
    assert TraceDriver.__mro__[1] is ProgramDriver.__mro__[1] is ChatDriver.__mro__[1]  # drivers.base.Driver


def _all_subclasses(cls) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub, *_all_subclasses(sub)}
    return found

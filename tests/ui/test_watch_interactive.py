"""`kvtui watch` on interactive programs (Pilot): the program's stdin is the input line under its output.
Keys typed there are the program's (q, e, space... are text, not kvtui's keys), Enter sends a line, up/down
browse the lines sent, ctrl+d ends the input (EOF), ctrl+c interrupts (SIGINT), esc gives the keys back."""

import asyncio
import os
import re
import textwrap
from pathlib import Path

import pytest

from kvtui import viewers
from kvtui.widgets.step.program_input import ProgramInput
from kvtui.widgets.step.program_output import ProgramOutput
from kvtui.widgets.step.token_buffer import TokenBufferPane
from pilot_helpers import wait_for

CHAT = Path(__file__).resolve().parents[2] / "samples" / "programs" / "chat_input.py"


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def wait_gone(pid: int, timeout: float = 5.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not gone(pid) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    return gone(pid)


def replies(output: ProgramOutput) -> list[str]:
    return [line for line in output.lines if line.startswith("bot> ")]


async def type_line(pilot, text: str) -> None:
    for ch in text:
        await pilot.press("space" if ch == " " else ch)


async def test_chat_through_the_input_line(tiny_dir):
    app = viewers.watch(str(CHAT), [str(tiny_dir("llama")), "4"])
    async with app.run_test(size=(160, 48)) as pilot:
        program_input = app.query_one(ProgramInput)
        output = app.query_one(ProgramOutput)
        # the program's prompt (no newline) shows as the last line, and the input line takes the focus once
        await wait_for(pilot, lambda: output.partial.get("stdout") == "you> ", 60, "the program's first prompt")
        await wait_for(pilot, lambda: app.focused is program_input, 10, "the input line to take the focus")
        assert app.view.latest is None  # nothing ran yet: it waits for its input

        # every letter is the program's: q (quit), e (export), space (step), r, p (pause), b (break), n
        await type_line(pilot, "queen bee reps")
        assert program_input.value == "queen bee reps"
        assert app.is_running and not app.view.driver.paused and not app.view.driver.break_on_alarm
        assert not any("export" in n.message for n in app._notifications)
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(replies(output)) == 1, 60, "the first reply")
        assert "you> queen bee reps" in output.lines  # echoed after its prompt, as a terminal shows it
        assert app.view.latest is not None and app.view.latest.source == "watch"
        first_steps = app.view.latest.step

        await wait_for(pilot, lambda: output.partial.get("stdout") == "you> ", 30, "the second prompt")
        await type_line(pilot, "hello there")
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(replies(output)) == 2, 60, "the second reply")
        assert "you> hello there" in output.lines
        # the program's own count of its cache is what the panes show at its last step
        await wait_for(pilot, lambda: app.view.latest.step > first_steps + 1, 30, "the second turn's steps")
        said = int(re.search(r"\[cache: (\d+) tokens\]", replies(output)[-1]).group(1))
        await wait_for(pilot, lambda: app.view.latest.cache_seq_length == said, 30, "the last step in the panes")
        assert app.is_running and not app.view.driver.paused and not app.view.driver.break_on_alarm

        # history: up/down browse the lines sent
        await pilot.press("up")
        assert program_input.value == "hello there"
        await pilot.press("up")
        assert program_input.value == "queen bee reps"
        await pilot.press("down", "down")
        assert program_input.value == ""

        # esc gives the keys back to the panes (b toggles break on alarm there), i takes them again
        await pilot.press("escape")
        assert isinstance(app.focused, TokenBufferPane)
        await pilot.press("b")
        assert app.view.driver.break_on_alarm
        await pilot.press("b", "i")
        assert app.focused is program_input and not app.view.driver.break_on_alarm

        # ctrl+d: EOF, the program says bye and ends with 0; the input line is closed
        pid = app.view.driver.source.process.pid
        await pilot.press("ctrl+d")
        await wait_for(pilot, lambda: app.view.driver.ended is not None, 30, "the program to end")
        assert app.view.driver.ended == 0
        await wait_for(pilot, lambda: "bye" in output.lines, 10, "its last line")
        assert program_input.disabled and "closed" in program_input.placeholder
        assert app.view.sub_title == "ended · exit 0"
        await pilot.press("q")
    assert await wait_gone(pid)


BLOCKED = {
    "input": 'import sys\nprint("started", flush=True)\nwhile True:\n    input("> ")\n',
    "sleep": 'import time\nprint("started", flush=True)\nwhile True:\n    time.sleep(0.05)\n',
}


@pytest.mark.parametrize("blocked", sorted(BLOCKED))
async def test_ctrl_c_interrupts_the_program_not_the_app(tmp_path, blocked):
    script = tmp_path / f"{blocked}.py"
    script.write_text(BLOCKED[blocked])
    app = viewers.watch(str(script), [])
    async with app.run_test(size=(120, 40)) as pilot:
        output = app.query_one(ProgramOutput)
        program_input = app.query_one(ProgramInput)
        await wait_for(pilot, lambda: "started" in output.lines, 30, "the program to start")
        if blocked == "input":
            await wait_for(pilot, lambda: app.focused is program_input, 10, "the prompt to focus the input")
        else:  # no prompt: the panes keep the keys until i
            await pilot.pause(0.3)
            assert app.focused is not program_input
            await pilot.press("i")
            assert app.focused is program_input
        pid = app.view.driver.source.process.pid
        await pilot.press("ctrl+c")
        await wait_for(pilot, lambda: app.view.driver.ended is not None, 30, "the program to end")
        assert app.view.driver.ended == 130  # a KeyboardInterrupt in the program: python's exit code after ctrl+c
        await wait_for(pilot, lambda: "stderr│ KeyboardInterrupt" in output.lines, 10, "the program's traceback")
        assert app.is_running and program_input.disabled
        await pilot.pause(0.2)
        assert app.is_running  # ctrl+c went to the program only
        await pilot.press("q")
    assert await wait_gone(pid)


async def test_partial_lines_and_progress_bars(tmp_path):
    """A line written in pieces shows as it grows; "\\r" keeps a bar's last state; a complete line replaces it."""
    script = tmp_path / "bar.py"
    script.write_text(
        textwrap.dedent("""
        import sys
        sys.stdout.write("loading 10%"); sys.stdout.flush()
        line = sys.stdin.readline()
        sys.stdout.write("\\rloading 100%\\n")
        print("got", repr(line))
        sys.stderr.write("warn: no newline"); sys.stderr.flush()
        sys.stdin.readline()
    """)
    )
    app = viewers.watch(str(script), [])
    async with app.run_test(size=(120, 40)) as pilot:
        output = app.query_one(ProgramOutput)
        await wait_for(pilot, lambda: output.partial.get("stdout") == "loading 10%", 30, "the partial line")
        app.view.driver.source.write_stdin("x\n")  # as Enter in the input line does
        await wait_for(pilot, lambda: "got 'x\\n'" in output.lines, 30, "the program's answer")
        assert "› x" not in output.lines and "loading 10%x" in output.lines  # echoed after the pending line
        assert "loading 100%" in output.lines  # the rest of the line, without the part already shown
        await wait_for(pilot, lambda: output.partial.get("stderr") == "stderr│ warn: no newline", 30, "stderr")
        await pilot.press("q")

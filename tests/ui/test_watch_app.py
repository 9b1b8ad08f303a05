"""`kvtui watch` in the TUI (Pilot): the program runs in its own process; pause blocks it before its
next forward, step lets exactly one through, break-on-alarm stops right after the alarm's step, and
quitting mid-run leaves no process behind."""

import asyncio
import os
import textwrap

import pytest

from kvtui import viewers
from kvtui.widgets.step.program_output import ProgramOutput
from pilot_helpers import wait_for

PROGRAM = textwrap.dedent("""
    import sys, time
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
    cache = DynamicCache(config=model.config)
    ids = tok("hello world", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache)
        for step in range(int(sys.argv[2])):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            # step 3 of the loop passes a cursor that starts from 0: an alarm
            extra = {"cache_position": torch.tensor([0])} if step == 2 else {}
            out = model(input_ids=token, past_key_values=cache, **extra)
            print(f"forward {step + 2}", flush=True)
            time.sleep(float(sys.argv[3]))
""")


@pytest.fixture
def program(tmp_path, tiny_dir):
    path = tmp_path / "loop.py"
    path.write_text(PROGRAM)
    return path, tiny_dir("llama")


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_pause_step_run_and_output(program):
    path, model = program
    app = viewers.watch(str(path), [str(model), "4", "0"], paused=True)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(
            pilot,
            lambda: app.view.driver.paused and app.view.driver.source is not None,
            60,
            "the program to start paused",
        )
        await pilot.pause(3.0)  # time enough to load the tiny model: still no forward while paused
        assert app.view.latest is None and app.view.driver.source.running
        await pilot.press("space")
        await wait_for(pilot, lambda: app.view.latest is not None, 60, "one step")
        await pilot.pause(1.5)
        assert app.view.latest.step == 1 and app.view.latest.phase == "prefill"  # exactly one forward went through
        await pilot.press("space")
        await wait_for(pilot, lambda: app.view.latest.step == 2, 30, "the second step")
        await pilot.pause(1.0)
        assert app.view.latest.step == 2
        # verify while held: its recompute is kvtui's forward, not a step of the program (it used to be one,
        # held by the same gate that was serving it: the program hung)
        await pilot.press("v")
        await wait_for(
            pilot, lambda: any("full recompute" in str(n.message) for n in app._notifications), 30, "the verify result"
        )
        assert any("matches a full recompute" in str(n.message) for n in app._notifications)
        await pilot.pause(1.0)
        assert app.view.latest.step == 2 and len(app.view.driver.replay.snapshots) == 2
        await pilot.press("r")
        await wait_for(pilot, lambda: app.view.driver.ended is not None, 60, "the program to end")
        assert app.view.driver.ended == 0 and app.view.latest.step == 5
        assert app.view.latest.source == "watch" and app.view.latest.caller.endswith("loop.py:16")
        output = app.query_one(ProgramOutput)
        await wait_for(pilot, lambda: any("forward 5" in line for line in output.lines), 10, "the program's output")
        assert {d.code for d in app.view.diagnostics} == {"ignored-argument", "cursor-mismatch"}
        await pilot.press("u")  # observe-only keys say why, nothing breaks
        await pilot.press("q")
    assert gone(app.view.driver.source.process.pid)


async def test_break_on_alarm_stops_at_the_alarm_step(program):
    path, model = program
    app = viewers.watch(str(path), [str(model), "6", "0"], break_on_alarm=True)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(pilot, lambda: app.view.latest is not None and app.view.driver.paused, 60, "the break")
        await pilot.pause(1.5)
        assert app.view.latest.step == 4  # the forward with the bad cache_position (prefill + 3 decodes)
        assert {d.code for d in app.view.latest.diagnostics} == {"ignored-argument", "cursor-mismatch"}
        await pilot.press("space")  # one more forward, then held again
        await wait_for(pilot, lambda: app.view.latest.step == 5, 30, "one step past the break")
        await pilot.pause(1.0)
        assert app.view.latest.step == 5 and app.view.driver.source.running
        await pilot.press("q")
    assert gone(app.view.driver.source.process.pid)


async def test_watch_with_attention_shades_by_the_program_steps(program):
    """`kvtui watch --attention`: the program's steps carry every layer's attention; selecting a layer (`]`)
    asks the program for that layer's heads, which the next step carries; the strip shows under the buffer."""
    from kvtui.widgets.step.attention_strip import AttentionStrip, shading
    from kvtui.widgets.step.token_buffer import TokenBufferPane

    path, model = program
    app = viewers.watch(str(path), [str(model), "4", "0"], paused=True, attention=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(
            pilot,
            lambda: app.view.driver.paused and app.view.driver.source is not None,
            60,
            "the program to start paused",
        )
        await pilot.press("space")
        await wait_for(pilot, lambda: app.view.latest is not None, 60, "one step")
        await pilot.pause(1.0)
        assert len(app.view.latest.attention) == 2 and app.view.latest.attention_detail.layer == 1
        app.query_one(TokenBufferPane).focus()
        while app.view.attention_view[0] != 0:
            await pilot.press("right_square_bracket")
        await pilot.press("space")
        await wait_for(pilot, lambda: app.view.latest.step == 2, 30, "the second step")
        await pilot.pause(1.0)
        assert app.view.latest.attention_detail.layer == 0  # the program kept the selected layer's heads
        pane = app.query_one(TokenBufferPane)
        assert app.query_one(AttentionStrip).display and pane.attention == shading(pane.snapshot, 0, None)
        await pilot.press("q")
    assert gone(app.view.driver.source.process.pid)


async def test_quit_mid_run_leaves_no_process(program):
    path, model = program
    app = viewers.watch(str(path), [str(model), "1000", "0.05"])
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(
            pilot, lambda: app.view.latest is not None and app.view.latest.step >= 3, 60, "the program to run"
        )
        pid = app.view.driver.source.process.pid
        await pilot.press("q")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 2.0
    while not gone(pid) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    assert gone(pid)


async def test_follow_a_trace_being_written(tmp_path, tiny_model):
    """replay --follow: steps appear as another process (here: a watcher in this test) appends them; a person
    who stepped back stays there, and stepping to the last step follows again."""
    import torch

    from kvtui.engine.watch.probe import watch

    model, tokenizer = tiny_model("llama")
    trace = tmp_path / "live.jsonl"
    watcher = watch(model, tokenizer, trace=trace)
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([[5, 6, 7]]))
        app = viewers.replay(trace, follow=True)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.view.latest is not None, 30, "the first step")
            with torch.inference_mode():
                model(input_ids=torch.tensor([[8, 9]]))
            await wait_for(pilot, lambda: app.view.latest.step == 2, 30, "the appended step")
            assert app.view.latest.buffer.ids() == [8, 9]  # a new cache (none passed): its own buffer
            await pilot.press("u")  # back to step 1: a new step does not move the screen
            await wait_for(pilot, lambda: app.view.latest.step == 1, 10, "step 1")
            with torch.inference_mode():
                model(input_ids=torch.tensor([[10]]))
            await wait_for(pilot, lambda: len(app.view.driver.replay) == 3, 30, "the third step read")
            await pilot.pause(0.3)
            assert app.view.latest.step == 1 and not app.view.driver.at_end
            await pilot.press("space", "space")  # to the last step: following again
            await wait_for(pilot, lambda: app.view.latest.step == 3, 10, "step 3")
            with torch.inference_mode():
                model(input_ids=torch.tensor([[11]]))
            await wait_for(pilot, lambda: app.view.latest.step == 4, 30, "the next appended step, shown")
            await pilot.press("q")
    finally:
        watcher.detach()

"""The engine process: the model runs in a child of the app, which dies with the app (even under
SIGKILL); an engine that dies is an alarm, and R restarts it with the chat fed into a fresh cache."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from kvtui import viewers
from kvtui.options import AppConfig
from kvtui.widgets.shared.status_bar import StatusBar
from pilot_helpers import start, wait_for, wait_idle

pytestmark = pytest.mark.real_engine  # the engine process's own life: a real `python -m kvtui.engine.chat.host`
SIZE = (140, 45)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # dead, waiting for init to reap it
    except psutil.NoSuchProcess:
        return True


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX SIGKILL")
def test_the_engine_process_dies_within_two_seconds_of_the_app_being_sigkilled(tiny_dir, tmp_path):
    """The real app (model by path, loaded in the engine) in a process of its own, generating; SIGKILL it."""
    script = tmp_path / "app.py"
    script.write_text(
        textwrap.dedent(f"""
        import asyncio
        from kvtui import viewers
        from kvtui.options import AppConfig

        async def main():
            app = viewers.chat(AppConfig(model={str(tiny_dir("qwen2"))!r}, options={{"max_new_tokens": 100000}}))
            async with app.run_test(size=(120, 40)) as pilot:
                while app.view.session is None:
                    await pilot.pause(0.05)
                app.query_one("#message").value = "What is k?"
                app.query_one("#message").focus()
                await pilot.press("enter")  # run mode: it generates until killed
                while app.view.latest is None or app.view.latest.step < 5:
                    await pilot.pause(0.05)
                import sys
                print(app.view.session.pid, "torch" in sys.modules, flush=True)
                await asyncio.sleep(600)

        asyncio.run(main())
    """)
    )
    app = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = app.stdout.readline().split()
        assert line and line[0].isdigit(), f"the app did not report its engine (exit {app.poll()})"
        engine = int(line[0])
        assert line[1] == "False"  # the model (and torch) live in the engine process only
        assert engine != app.pid and psutil.Process(engine).ppid() == app.pid and not gone(engine)
        command = psutil.Process(engine).cmdline()
        setup = Path(command[command.index("--setup") + 1])
        spool = next(Path(f.path) for f in psutil.Process(engine).open_files() if f.path.endswith(".jsonl"))
        assert not setup.exists()  # read once the model loaded: removed then
        os.kill(app.pid, signal.SIGKILL)
        app.wait(10)
        killed = time.monotonic()
        while not gone(engine) and time.monotonic() - killed < 2.0:
            time.sleep(0.02)
        assert gone(engine), "the engine process outlived the app by 2 s"
        assert not spool.parent.exists() and not setup.parent.exists()  # a killed app leaves no file behind
    finally:
        if app.poll() is None:
            app.kill()


@pytest.mark.parametrize("how", ["kill", "exit"])
async def test_a_dead_engine_is_an_alarm_and_R_restarts_it_with_the_chat(tiny_loaded, tmp_path, how):
    from engine_faults import die_on_step

    app = viewers.chat(
        AppConfig(options={"max_new_tokens": 8}),
        loaded=tiny_loaded("qwen2"),
        engine_setup=die_on_step(how, tmp_path / "died"),
    )
    async with app.run_test(size=SIZE) as pilot:
        await start(pilot, app)  # the prefill ran
        first = app.view.session.pid
        before = app.view.latest
        await pilot.press("space")  # the engine dies in this step
        await wait_for(pilot, lambda: app.view.app_diagnostics, 30, "the alarm")
        alarm = app.view.app_diagnostics[-1]
        assert alarm.code == "worker-error" and alarm.severity == "error"
        expected = "killed by SIGKILL" if how == "kill" else "exited with code 3: fatal: simulated crash"
        assert expected in alarm.message, alarm.message
        assert "R restarts" in app.query_one(StatusBar).model_text or any(
            "R restarts" in str(n.message) for n in app._notifications
        )
        assert not app.view.engine_busy and gone(first)
        await pilot.press("space")  # refused, said so: nothing to send it to
        assert any("R restarts it" in str(n.message) for n in app._notifications)

        await pilot.press("R")
        await wait_for(
            pilot, lambda: app.view.session is not None and app.view.latest.phase == "restore", 120, "the restore"
        )
        await wait_idle(pilot, app)
        restored = app.view.latest
        assert app.view.session.pid != first
        # the whole chat went into the new cache in one forward, numbered after the last step
        assert restored.step == before.step + 1 and restored.buffer.ids() == before.buffer.ids()
        assert (
            len(restored.input_ids) == len(before.buffer) == restored.cache_seq_length == app.view.session.cache_length
        )
        assert restored.chosen.id == before.chosen.id  # the same next token: the same logits, within tolerance
        await pilot.press("v")
        await wait_idle(pilot, app)
        assert app.view.driver.meter.last_verify is not None and app.view.driver.meter.last_verify.ok
        await pilot.press("space")  # and the chat goes on
        await wait_idle(pilot, app)
        assert app.view.latest.step == restored.step + 1 and app.view.latest.phase == "decode"
        assert app.view.latest.input_ids == (before.chosen.id,)


async def test_loading_progress_streams_to_the_status_bar(tiny_dir, monkeypatch):
    shown: list[str] = []
    real = StatusBar.set_text

    def recording(self, text):
        shown.append(text)
        real(self, text)

    monkeypatch.setattr(StatusBar, "set_text", recording)
    app = viewers.chat(AppConfig(model=str(tiny_dir("qwen2"))))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.session is not None, 120, "the model")
    assert any("starting the engine process" in text for text in shown), shown
    assert any("weights" in text for text in shown), shown
    assert any(text.startswith("⏳ loaded") and text.endswith("100%") for text in shown), shown


def test_commands_are_one_line_each_and_read_back_as_sent():
    from kvtui.engine.records.stream import format_command, parse_command

    for word, argument in [
        ("step", None),
        ("rewind", 3),
        ("send", {"text": "two\nlines «é»", "run": True}),
        ("sampler", {"temperature": 0.7, "top_k": 5, "top_p": 1.0, "repetition_penalty": 1.0, "seed": None}),
    ]:
        line = format_command(word, argument)
        assert "\n" not in line
        assert parse_command(line + "\n") == (word, argument)
    assert parse_command("break on") == ("break", "on")  # the watch child's bare words


def test_the_engine_threads_spin_briefly_before_they_sleep_unless_the_user_says_how_to_wait():
    from kvtui.engine.records.child import ENGINE_SPIN_COUNT, openmp_wait

    assert openmp_wait({}) == {"GOMP_SPINCOUNT": str(ENGINE_SPIN_COUNT)}
    assert openmp_wait({"OMP_WAIT_POLICY": "PASSIVE"}) == {}  # the user's own setting wins
    assert openmp_wait({"GOMP_SPINCOUNT": "20000"}) == {}


async def test_the_engine_process_gets_the_short_spin(tiny_dir, monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    app = viewers.chat(AppConfig(model=str(tiny_dir("qwen2"))))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.session is not None, 120, "the model")
        environ = psutil.Process(app.view.session.pid).environ()
    assert environ.get("GOMP_SPINCOUNT") == "1000" and "OMP_WAIT_POLICY" not in environ


async def test_attention_of_the_layer_selected_in_the_layers_pane(tiny_dir):
    """--attention through the engine process: every step carries every layer's newest-query attention (the
    model keeps its sdpa), the per-head rows of the layer the layers pane (or `]`) selects, read at the next
    forward; `[`/`]` and `{`/`}` move the buffer's shading through all layers, each layer and its heads."""
    from kvtui.widgets.step.attention_strip import AttentionStrip, shading
    from kvtui.widgets.step.layers_pane import LayersPane
    from kvtui.widgets.step.token_buffer import TokenBufferPane

    app = viewers.chat(AppConfig(model=str(tiny_dir("qwen2")), options={"max_new_tokens": 8, "attention": True}))
    async with app.run_test(size=SIZE) as pilot:
        await start(pilot, app)
        snapshot = app.view.latest
        assert app.view.attention_view == (None, None)  # opens on all layers: the table's first row is no choice
        last = len(snapshot.layers) - 1
        assert len(snapshot.attention) == len(snapshot.layers) and snapshot.attention_layer == last
        assert all(len(entries) >= min(8, len(snapshot.buffer)) for entries in snapshot.attention)
        assert app.query_one(AttentionStrip).display
        pane = app.query_one(TokenBufferPane)
        assert pane.attention == shading(pane.snapshot, *app.view.attention_view)  # the painted step's
        app.query_one(LayersPane).post_message(LayersPane.LayerSelected(0))
        await pilot.pause(0.2)
        await pilot.press("space")
        await wait_idle(pilot, app)
        assert app.view.latest.attention_layer == 0 and app.view.latest.attention_detail.layer == 0
        assert app.view.attention_view == (0, None)
        await pilot.press("right_curly_bracket")  # head 0 of layer 0
        await pilot.pause(0.1)
        assert app.view.attention_view == (0, 0)
        assert pane.attention == shading(pane.snapshot, 0, 0) != shading(pane.snapshot, 0, None)
        await pilot.press("left_square_bracket")  # back to all layers
        await pilot.pause(0.1)
        assert app.view.attention_view == (None, None)
        assert "all 2 layers" in str(app.query_one(AttentionStrip).render())
        app.view.action_run()  # the rest of the turn: no step comes after it
        await wait_for(pilot, lambda: app.view.latest.turn_done and not app.view.engine_busy, 60, "the turn's end")
        await wait_idle(pilot, app)
        assert app.view.latest.attention_detail.layer == 0
        await pilot.press("right_square_bracket", "right_square_bracket")  # layer 1, whose heads were not kept
        await pilot.pause(0.1)
        assert app.view.attention_view == (1, None)
        await pilot.press("right_curly_bracket")
        await pilot.pause(0.1)
        said = [str(n.message) for n in app._notifications]
        assert any("the turn is over" in m and "kept the heads of layer 0" in m for m in said), said
        assert not any("arrive with the next step" in m for m in said)


async def test_a_loaded_model_that_does_not_pickle_is_handed_over_with_save_pretrained(tiny_dir):
    """transformers leaves local-function hooks on a model once it captured outputs (and a user's model may
    hold anything): such a model reaches the engine process through save_pretrained, same names and weights."""
    from kvtui.engine.chat.loader import load_model

    loaded = load_model(str(tiny_dir("qwen2")), dtype="float32", device="cpu")
    loaded.model.register_forward_hook(lambda module, args, output: None)  # a lambda: pickle refuses it
    app = viewers.chat(AppConfig(options={"max_new_tokens": 4}), loaded=loaded)
    async with app.run_test(size=SIZE) as pilot:
        await start(pilot, app)
        assert app.view.session.description.startswith(loaded.source)
        await pilot.press("v")
        await wait_idle(pilot, app)
        assert app.view.driver.meter.last_verify is not None and app.view.driver.meter.last_verify.ok
        ids = app.view.latest.buffer.ids()
        import torch

        with torch.inference_mode():  # the same weights: this process's model picks the same next token
            logits = loaded.model(torch.tensor([ids])).logits[0, -1]
        assert int(logits.argmax()) == app.view.latest.chosen.id
        with pytest.raises((pickle.PicklingError, AttributeError)):
            pickle.dumps(loaded)  # so it went over as save_pretrained files...
        assert not app.view.driver.source.directory.exists()  # ...which the engine removed once it had loaded them

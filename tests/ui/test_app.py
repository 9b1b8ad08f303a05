"""Pilot tests of the real app on a tiny local model: every pane shows what the engine's snapshot says."""

from __future__ import annotations

import sys
import time

from textual.widgets import Input

from kvtui import viewers
from kvtui.options import AppConfig
from kvtui.widgets.shared.status_bar import StatusBar
from kvtui.widgets.step.cursor_pane import CursorPane
from kvtui.widgets.step.diagnostics_pane import DiagnosticsPane
from kvtui.widgets.step.layers_pane import LayersPane, format_shape
from kvtui.widgets.step.token_buffer import TokenBufferPane
from kvtui.widgets.step.topk_pane import TopKPane
from pilot_helpers import start, wait_for, wait_idle

SIZE = (140, 45)


def make_app(loaded, **options):
    return viewers.chat(AppConfig(options={"max_new_tokens": 8, **options}), loaded=loaded)


def cursor_text(app) -> str:
    return app.query_one(CursorPane).visual.plain


def table_text(table) -> list[str]:
    return [" ".join(str(c) for c in table.get_row_at(i)) for i in range(table.row_count)]


async def test_send_and_step_five_tokens_every_pane_agrees_with_the_snapshot(tiny_loaded, monkeypatch, tmp_path):
    from kvtui.engine.reading.export import load_cache

    monkeypatch.chdir(tmp_path)  # the engine process exports into its working directory, this one
    app = make_app(tiny_loaded("qwen2"))
    async with app.run_test(size=SIZE) as pilot:
        await start(pilot, app)
        assert app.view.latest.phase == "prefill"
        for _ in range(5):
            await pilot.press("space")
            await wait_idle(pilot, app)
        snapshot = app.view.latest
        assert snapshot.step == 6 and snapshot.phase == "decode"
        # the snapshot tells the truth about the real cache (independent reads): the engine process writes
        # its K/V tensors out (e), and they are read back here with safetensors
        await pilot.press("e")
        await wait_idle(pilot, app)
        export = load_cache(tmp_path / f"kvtui-cache-step{snapshot.step}.safetensors")
        assert snapshot.cache_seq_length == app.view.session.cache_length == export.keys[0].shape[-2]
        # cursor pane
        text = cursor_text(app)
        assert f"cursor {snapshot.cursor}" in " ".join(text.split())
        assert str(snapshot.cache_seq_length) in text and "decode" in text and "ALARM" not in text
        # layers pane: one row per layer with the cache's own K shape
        layers = app.query_one(LayersPane).table
        assert layers.row_count == len(export.keys)
        rows = table_text(layers)
        compact = "kv" in [str(key.value) for key in layers.columns]  # a pane too narrow for both shapes
        for row, keys, values in zip(rows, export.keys, export.values):
            if compact:  # 'K=V 2×42×16': batch 1 left out, K and V alike (read from the cache's own tensors)
                assert keys.shape[0] == 1 and keys.shape == values.shape
                assert f"K=V {format_shape(tuple(keys.shape[1:]))}" in row
            else:
                assert format_shape(tuple(keys.shape)) in row
        # top-k pane: the processed top tokens, in order, chosen marked
        topk = app.query_one(TopKPane)
        ids = [t.id for t in snapshot.topk_processed[:3]]
        shown = table_text(topk.table)
        for row, token_id in zip(shown, ids):
            assert str(token_id) in row
        assert "▶" in shown[0]
        # token buffer: the whole cache, cursor at the end
        buffer = app.query_one(TokenBufferPane)
        assert len(buffer.snapshot.buffer) == snapshot.cache_seq_length == snapshot.cursor
        assert f"{snapshot.cache_seq_length} tokens" in str(buffer.border_title)
        assert f"next pos {snapshot.cursor}" in str(buffer.border_title)
        # status bar: a sparkline point per step
        assert len(app.query_one(StatusBar).latency) == 6


BUDGET = 50_000


async def test_run_then_pause_then_run(tiny_loaded):
    # a budget the run cannot use up before `p` is handled, even while a vLLM server starts beside the suite (a
    # fresh-clone CI ran all 4,000 tiny-model steps before the key landed; pausing is what is tested, not speed)
    app = make_app(tiny_loaded("qwen2"), max_new_tokens=BUDGET)
    async with app.run_test(size=SIZE) as pilot:
        await start(pilot, app, step_mode=True)
        await pilot.press("r")
        await wait_for(pilot, lambda: app.view.latest.step > 5, what="a few run steps")
        await pilot.press("p")
        await wait_idle(pilot, app)
        paused_at = app.view.latest.step
        assert paused_at < BUDGET and app.view.latest.cursor == app.view.session.cache_length
        # paused, not running: one step (answered by the engine) moves exactly one past where the pause held it
        await pilot.press("space")
        await wait_idle(pilot, app)
        assert app.view.latest.step == paused_at + 1
        paused_at = app.view.latest.step
        await pilot.press("r")
        await wait_for(pilot, lambda: app.view.latest.step > paused_at + 3, what="running again")
        await pilot.press("p")
        await wait_idle(pilot, app)


async def test_rewind_and_rewind_to_selected(tiny_loaded):
    app = make_app(tiny_loaded("qwen2"))
    async with app.run_test(size=SIZE) as pilot:
        await start(pilot, app)
        for _ in range(3):
            await pilot.press("space")
            await wait_idle(pilot, app)
        before = app.view.latest.cursor
        await pilot.press("u")
        await wait_idle(pilot, app)
        assert (
            app.view.latest.phase == "rewind" and app.view.latest.cursor == before - 1 == app.view.session.cache_length
        )
        buffer = app.query_one(TokenBufferPane)
        buffer.focus()
        buffer.select(10)
        await pilot.press("backspace")
        await wait_idle(pilot, app)
        assert app.view.latest.cursor == 10 == app.view.session.cache_length
        assert len(buffer.snapshot.buffer) == 10


async def test_force_the_selected_alternative(tiny_loaded):
    app = make_app(tiny_loaded("qwen2"))
    async with app.run_test(size=SIZE) as pilot:
        await start(pilot, app)
        alternative = app.view.latest.topk_processed[2]
        topk = app.query_one(TopKPane)
        topk.table.focus()
        topk.table.move_cursor(row=2)
        await pilot.press("f")
        await wait_for(pilot, lambda: app.view.latest.step >= 2, what="the forced step")
        await wait_idle(pilot, app)
        last = app.view.latest.buffer[-1]  # force feeds the alternative at once (step mode stops after it)
        assert (last.id, last.origin) == (alternative.id, "forced")
        assert app.view.latest.input_ids == (alternative.id,)


async def test_verify_reports_agreement(tiny_loaded):
    app = make_app(tiny_loaded("qwen2"))
    async with app.run_test(size=SIZE) as pilot:
        await start(pilot, app)
        await pilot.press("space")
        await wait_idle(pilot, app)
        await pilot.press("v")
        await wait_idle(pilot, app)
        await wait_for(
            pilot,
            lambda: any("full recompute" in str(n.message) for n in app._notifications),
            what="the verify notification",
        )
        note = next(str(n.message) for n in app._notifications if "full recompute" in str(n.message))
        assert "matches" in note and "cache-mismatch" not in [d.code for d in app.view.diagnostics]


async def test_static_overflow_shows_the_refusal_and_the_app_goes_on(tiny_loaded):
    loaded = tiny_loaded("qwen2")
    prompt_len = len(
        loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is k?"}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
    )
    app = make_app(loaded, cache="static", max_cache_len=prompt_len + 3, max_new_tokens=50)
    async with app.run_test(size=SIZE) as pilot:
        await start(pilot, app, step_mode=False)  # runs until the cache refuses
        assert app.view.session.cache_length == prompt_len + 3
        diagnostics = app.query_one(DiagnosticsPane)
        rows = table_text(diagnostics.table)
        assert any("static-capacity" in r and "error" in r for r in rows)
        assert any("overflow refused" in str(n.message) for n in app._notifications)
        await pilot.press("u")
        await wait_idle(pilot, app)
        await pilot.press("space")
        await wait_idle(pilot, app)
        assert app.view.latest.cursor == app.view.session.cache_length == prompt_len + 3


async def test_worker_exception_is_shown_and_the_session_survives(tiny_loaded):
    from engine_faults import fail_once

    app = viewers.chat(
        AppConfig(options={"max_new_tokens": 8}),
        loaded=tiny_loaded("qwen2"),
        engine_setup=fail_once("step", "simulated failure"),
    )  # the next step raises, the one after works
    async with app.run_test(size=SIZE) as pilot:
        await start(pilot, app)
        await pilot.press("space")
        await wait_for(pilot, lambda: app.view.app_diagnostics, what="the worker error")
        assert (
            app.view.app_diagnostics[0].code == "worker-error"
            and "simulated failure" in app.view.app_diagnostics[0].message
        )
        assert any("worker-error" in r for r in table_text(app.query_one(DiagnosticsPane).table))
        before = app.view.latest.step
        await pilot.press("space")
        await wait_idle(pilot, app)
        assert app.view.latest.step == before + 1


async def test_missing_model_is_a_clear_error_and_the_app_keeps_running(tmp_path):
    app = viewers.chat(AppConfig(model=str(tmp_path / "no-such-model")))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: "no model" in app.view.model_text, what="the load error")
        assert "does not exist" in app.view.model_text
        await pilot.press("space")  # still answers keys
        await pilot.pause(0.1)
        assert any("does not exist" in str(n.message) for n in app._notifications)


async def test_quit_mid_generation_leaves_no_thread_and_no_engine_process(tiny_loaded):
    import psutil

    app = make_app(tiny_loaded("qwen2"), max_new_tokens=100000)
    async with app.run_test(size=SIZE) as pilot:
        await start(pilot, app, step_mode=True)
        engine = app.view.session.pid
        assert psutil.pid_exists(engine) and engine != psutil.Process().pid
        await pilot.press("r")
        await wait_for(pilot, lambda: app.view.latest.step > 3, what="running")
        await pilot.press("q")
        await pilot.pause(0.2)
    assert app.view.latest.step < 100000
    assert all(worker.is_finished for worker in app.workers)
    assert not psutil.pid_exists(engine)  # quit waited for the engine process: it is gone, not a zombie
    # no thread is left inside the engine or the model (an idle executor thread is not ours): the readers of the
    # engine's pipes end at their EOF, which a loaded machine may deliver a moment after quit returned
    deadline = time.monotonic() + 10
    while _busy_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _busy_threads() == []


def _busy_threads() -> list[int]:
    return [
        thread_id
        for thread_id, frame in sys._current_frames().items()
        if any(name in path for path in _stack_files(frame) for name in ("kvtui/engine", "transformers/models"))
    ]


def _stack_files(frame):
    while frame is not None:
        yield frame.f_code.co_filename
        frame = frame.f_back


async def test_help_sampler_and_pane_toggles(tiny_loaded):
    app = make_app(tiny_loaded("qwen2"))
    async with app.run_test(size=SIZE) as pilot:
        await start(pilot, app)
        await pilot.press("question_mark")
        await pilot.pause(0.1)
        assert type(app.screen).__name__ == "HelpScreen"
        await pilot.press("escape")
        await pilot.press("f5")
        await pilot.pause(0.1)
        assert not app.query_one(LayersPane).display
        await pilot.press("f5")
        await pilot.pause(0.1)
        assert app.query_one(LayersPane).display
        await pilot.press("o")
        await pilot.pause(0.2)
        assert type(app.screen).__name__ == "SamplerModal"
        app.screen.query_one("#field-temperature", Input).value = "0.8"
        app.screen.query_one("#field-top_k", Input).value = "5"
        await pilot.click("#apply")
        await wait_idle(pilot, app)
        assert (
            app.view.session.sampler.temperature == 0.8 and app.view.session.sampler.top_k == 5
        )  # the engine's answer
        # the status line names the sampler now in use, beside the step's numbers (it kept the one the
        # engine started with: "greedy" after T=0.8)
        line = str(app.query_one(StatusBar).query_one("#status-text").content)  # the line as shown
        assert "T=0.8 top-k=5" in line and "greedy" not in line and "tok/s" in line, line
        await pilot.press("space")
        await wait_idle(pilot, app)
        # top-k 5 after the processors: at most 5 tokens keep probability
        assert sum(1 for t in app.view.latest.topk_processed if t.prob > 0) <= 5


async def test_reuse_meter_and_watch(tiny_loaded):
    from kvtui.widgets.step.chat_pane import ChatPane

    app = make_app(tiny_loaded("qwen2"), max_new_tokens=3)
    async with app.run_test(size=SIZE) as pilot:
        await start(pilot, app, step_mode=False)
        first = app.view.driver.meter.prefill
        assert first is not None and len(first.buffer) - len(first.input_ids) == 0
        chat_input = app.query_one("#message", Input)
        chat_input.focus()
        chat_input.value = "And m?"
        await pilot.press("enter")
        await wait_idle(pilot, app)
        second = app.view.driver.meter.prefill
        reused = len(second.buffer) - len(second.input_ids)
        assert reused > 0 and second.turn == 2
        reuse = app.query_one(ChatPane).query_one("#reuse").visual.plain
        assert f"reused {reused} cached tokens, fed {len(second.input_ids)}" in reuse
        await pilot.press("v")
        await wait_idle(pilot, app)
        await wait_for(
            pilot,
            lambda: "full re-encode of" in app.query_one(ChatPane).query_one("#reuse").visual.plain,
            what="the re-encode cost",
        )
        # watch the third top-k token: from the next step it is reported wherever it ranks
        topk = app.query_one(TopKPane)
        topk.table.focus()
        topk.table.move_cursor(row=2)
        watched = topk.selected_token_id
        await pilot.press("w")
        await pilot.press("u")  # a rewind re-feeds a token: a new step
        await wait_idle(pilot, app)
        assert [t.id for t in app.view.latest.watched] == [watched]


def test_only_plain_decode_snapshots_are_coalesced():
    """Textual asks the queued (older) message whether the next may supersede it."""
    from kvtui.engine.records.snapshot import Diagnostic, StepSnapshot, TokenBuffer
    from kvtui.messages import SnapshotReady

    def message(phase, diagnostics=()):
        snapshot = StepSnapshot(
            step=1,
            phase=phase,
            turn=1,
            input_ids=(1,),
            positions=(0,),
            cursor=1,
            cache_seq_length=1,
            capacity=None,
            layers=(),
            topk=(),
            topk_processed=(),
            watched=(),
            chosen=None,
            chosen_forced=False,
            diagnostics=diagnostics,
            forward_ms=0.0,
            snapshot_ms=0.0,
            buffer=TokenBuffer([]),
        )
        return SnapshotReady(snapshot, [], (), True)

    newer = message("decode")
    assert message("decode").can_replace(newer)
    assert not message("prefill").can_replace(newer)
    assert not message("decode", (Diagnostic("sliding-eviction", "info", "m", 1),)).can_replace(newer)


async def test_a_message_the_static_cache_refuses_stays_in_the_input(tiny_loaded):
    # the prefill is refused before any forward (static-capacity); the input was cleared on Enter and the
    # message lost: it comes back to be shortened or sent after a reset
    app = make_app(tiny_loaded("qwen2"), cache="static", max_cache_len=24)
    long = ("Tell me everything about k, m and every other variable we have defined. " * 3).strip()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.session is not None, timeout=60, what="the model")
        chat_input = app.query_one("#message", Input)
        chat_input.focus()
        chat_input.value = long
        await pilot.press("enter")
        await wait_idle(pilot, app)
        await wait_for(pilot, lambda: chat_input.value == long, what="the refused message back in the input")
        assert "static-capacity" in {d.code for d in app.view.diagnostics}
        assert app.view.session.turn == 0 and app.view.latest is None  # nothing was fed

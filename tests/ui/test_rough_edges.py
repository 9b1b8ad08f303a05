"""Rough edges a new user hit (issue 10), each pinned by a test that failed before its fix."""

from __future__ import annotations

from textual.widgets import Input

from kvtui import viewers
from kvtui.options import AppConfig
from pilot_helpers import wait_for, wait_idle


async def test_a_message_sent_before_the_model_is_ready_is_sent_when_it_is(tiny_dir, tmp_path):
    from engine_faults import gated_load

    gate = tmp_path / "load-now"
    app = viewers.chat(
        AppConfig(model="anything", options={"max_new_tokens": 2}), loader=gated_load(gate, tiny_dir("qwen2"))
    )  # the engine waits for the gate file
    async with app.run_test(size=(140, 45)) as pilot:
        box = app.query_one("#message", Input)
        box.focus()  # the panes hold the keys at start-up
        box.value = "What is k?"
        await pilot.press("enter")
        await pilot.pause(0.2)
        assert app.view.session is None
        assert any("queued" in str(n.message) for n in app._notifications)
        gate.touch()
        await wait_for(pilot, lambda: app.view.latest is not None, 60, what="the queued message's prefill")
        await wait_idle(pilot, app)
        assert app.view.messages[0]["content"] == "What is k?"


async def test_layers_pane_keeps_the_bytes_column_in_view_at_160_columns(tiny_loaded):
    """At 160x48 the layers pane is about 59 cells wide: with SmolLM2's shapes (30 layers of
    1×3×225×64) the bytes, with their unit, must be visible without scrolling; the long shapes and
    dtype/device come after them (and dtype/device are in the totals line)."""
    from kvtui.widgets.step.layers_pane import LayersPane
    from test_panes import make_layer, make_snapshot

    layers = tuple(make_layer(i, "full", 225, kv_heads=3, head_dim=64) for i in range(30))
    app = viewers.chat(AppConfig(options={"max_new_tokens": 4}), loaded=tiny_loaded("llama"))
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(pilot, lambda: app.view.session is not None, what="the model")
        pane = app.query_one(LayersPane)
        pane.show(make_snapshot(cursor=225, cache_seq_length=225, layers=layers))
        await pilot.pause(0.2)
        table = pane.table
        width = table.scrollable_content_region.width
        keys = [str(key.value) for key in table.columns]
        upto = keys[: keys.index("bytes") + 1]
        reach = sum(table.columns[k].get_render_width(table) for k in table.columns if str(k.value) in upto)
        assert width < 70 and reach <= width, (reach, width)
        row = [str(cell) for cell in table.get_row_at(0)]
        assert row[keys.index("bytes")] == "337.5 KiB"
        assert "float32 on cpu" in str(pane.query_one("#layers-totals").render())


async def test_reuse_meter_says_when_the_ui_was_busy_during_a_timing(tiny_loaded):
    """The reuse meter compares the prefill with a full re-encode (v): a figure taken while the UI
    was busy (on 2 cores it competes with the engine process for the CPU) says so, so a learner is
    not told that caching was slower."""
    import time as clock

    from engine_faults import slow_first_forward
    from kvtui.widgets.step.chat_pane import ChatPane

    # in the engine process, the prefill's forward takes 300 ms of wall time (sleeping)
    app = viewers.chat(
        AppConfig(options={"max_new_tokens": 4}), loaded=tiny_loaded("qwen2"), engine_setup=slow_first_forward
    )
    async with app.run_test(size=(140, 45)) as pilot:
        await wait_for(pilot, lambda: app.view.session is not None, what="the model")

        def burn():  # the UI thread works 8 ms of every 10
            end = clock.thread_time() + 0.008
            while clock.thread_time() < end:
                pass

        burner = app.set_interval(0.01, burn)
        app.view.step_mode = True
        box = app.query_one("#message")
        box.focus()
        box.value = "What is k?"
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.view.latest is not None, what="the prefill")
        burner.stop()
        await wait_idle(pilot, app)
        text = str(app.query_one(ChatPane).query_one("#reuse").render())
        assert "prefill" in text and "UI busy" in text, text
        assert app.view.driver.meter.prefill_ui_ms is not None and app.view.driver.meter.prefill_ui_ms >= 20

"""Rough edges a new user hit (issue 10), each pinned by a test that failed before its fix."""

from __future__ import annotations

from textual.widgets import Input

from kvtui.app import KvtuiApp
from kvtui.options import AppConfig

from pilot_helpers import wait_for, wait_idle


async def test_a_message_sent_before_the_model_is_ready_is_sent_when_it_is(tiny_loaded):
    import threading

    gate = threading.Event()
    loaded = tiny_loaded("qwen2")

    import kvtui.app as app_module

    real_load = app_module.load

    def waiting_load(*args, **kwargs):
        gate.wait(30)
        return loaded

    app_module.load = waiting_load
    try:
        app = KvtuiApp(AppConfig(model="anything", options={"max_new_tokens": 2}))
        async with app.run_test(size=(140, 45)) as pilot:
            box = app.query_one("#message", Input)
            box.value = "What is k?"
            await pilot.press("enter")
            await pilot.pause(0.2)
            assert app.session is None
            assert any("queued" in str(n.message) for n in app._notifications)
            gate.set()
            await wait_for(pilot, lambda: app.latest is not None, what="the queued message's prefill")
            await wait_idle(pilot, app)
            assert app.messages[0]["content"] == "What is k?"
    finally:
        app_module.load = real_load

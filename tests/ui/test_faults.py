"""Fault injection: an exception at load, in a step, in verify and in export is a clear message in the
TUI (what happened, what to do next), the session stays as it was, and `q` still quits."""

from __future__ import annotations

import pytest

from kvtui import viewers
from kvtui.options import AppConfig
from kvtui.widgets.shared.status_bar import StatusBar
from pilot_helpers import start, wait_for, wait_idle

SIZE = (140, 45)


def notices(app) -> list[str]:
    return [n.message for n in app._notifications]


async def test_exception_at_load_is_said_and_q_quits():
    from engine_faults import broken_load

    app = viewers.chat(AppConfig(model="whatever"), loader=broken_load)  # raises in the engine process
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.view.driver.load_failed, what="the load failure")
        await pilot.pause(0.2)
        assert "RuntimeError: disk on fire" in app.query_one(StatusBar).model_text
        assert any("disk on fire" in n and "q quits" in n for n in notices(app))
        await pilot.press("space")  # keys still answer (no model: they say so)
        await pilot.press("q")
    assert app.return_code in (0, None)


@pytest.mark.parametrize("action,key", [("step", "space"), ("verify", "v"), ("export", "e")])
async def test_exception_in_an_action_keeps_the_session(tiny_loaded, monkeypatch, tmp_path, action, key):
    from engine_faults import fail_once

    monkeypatch.chdir(tmp_path)  # export writes into the working directory
    message = "no space left on device" if action == "export" else f"simulated failure in {action}"
    # in the engine process, the first call of the action raises; the ones after work
    app = viewers.chat(
        AppConfig(options={"max_new_tokens": 8}), loaded=tiny_loaded("qwen2"), engine_setup=fail_once(action, message)
    )
    async with app.run_test(size=SIZE) as pilot:
        await start(pilot, app)
        before = (app.view.latest.step, app.view.session.buffer.ids(), app.view.session.cache_length)
        await pilot.press(key)
        await wait_for(pilot, lambda: app.view.app_diagnostics, what="the worker error")
        await wait_idle(pilot, app)
        message = app.view.app_diagnostics[-1].message
        assert app.view.app_diagnostics[-1].code == "worker-error" and (
            "simulated failure" in message or "no space" in message
        )
        assert any("session is as it was" in n and "q quits" in n for n in notices(app))
        assert (
            app.view.latest.step,
            app.view.session.buffer.ids(),
            app.view.session.cache_length,
        ) == before  # nothing half done
        await pilot.press("space")  # still usable
        await wait_idle(pilot, app)
        assert app.view.latest.step == before[0] + 1
        await pilot.press("q")

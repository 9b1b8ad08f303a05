"""Waiting helpers for pilot tests: the engine runs in its own process, so tests wait on conditions."""

from __future__ import annotations

import asyncio


async def wait_for(pilot, predicate, timeout: float = 30.0, what: str = "condition"):
    """Let the app and its worker threads run until predicate() holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.05)


async def wait_idle(pilot, app, timeout: float = 30.0):
    """Until the engine answered every command sent and the last snapshot reached the panes."""
    await wait_for(pilot, lambda: not app.view.engine_busy, timeout, "the engine to finish its commands")
    await wait_for(pilot, lambda: app.view._paint_timer is None, timeout, "the throttled repaint")
    await pilot.pause(0.1)


# A model load starts a Python that imports torch and transformers (kvpress too under --press): seconds alone, a
# minute on CI's two cores shared by both suites. The wait is not what these tests check.
LOAD_TIMEOUT = 180.0


async def start(pilot, app, text="What is k?", step_mode=True):
    """Wait for the model, then send `text` from the input (step mode: only the prefill runs)."""
    from textual.widgets import Input

    loaded = lambda: app.view.session is not None or app.view.driver.load_failed  # noqa: E731
    await wait_for(pilot, loaded, LOAD_TIMEOUT, "the model to load")
    assert app.view.session is not None, app.view.model_text
    app.view.step_mode = step_mode
    chat_input = app.query_one("#message", Input)
    chat_input.focus()
    chat_input.value = text
    await pilot.press("enter")
    await wait_for(pilot, lambda: app.view.latest is not None, what="the prefill")
    await wait_idle(pilot, app)


class FakeClock:
    """Each reading advances 1 ms: snapshot timings become deterministic."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.001
        return self.now

"""SVG snapshots of the main screen after a few steps, on a deterministic tiny model, in two themes and four sizes;
before each snapshot the screen's text is checked for the facts every size must show (test_layout.assert_facts:
a layer's K/V shape, a top-k probability, the template's special tokens whole, cursor and cache length).

Update after an intended change of the look: `make test PYTEST_ARGS="tests/ui/test_snapshots.py --snapshot-update"`,
then look at the SVGs in tests/ui/__snapshots__ before committing them.
"""

from __future__ import annotations

import pytest
from textual.widgets import Input

from kvtui import viewers
from kvtui.options import AppConfig
from pilot_helpers import LOAD_TIMEOUT, FakeClock, wait_for, wait_idle
from test_layout import assert_facts, screen_text


async def three_steps(pilot):
    app = pilot.app
    await wait_for(pilot, lambda: app.view.session is not None, LOAD_TIMEOUT, "the model to load")
    app.view.step_mode = True
    chat_input = app.query_one("#message", Input)
    chat_input.cursor_blink = False
    chat_input.focus()
    chat_input.value = "What is k?"
    await pilot.press("enter")
    await wait_for(pilot, lambda: app.view.latest is not None, what="the prefill")
    await wait_idle(pilot, app)
    for _ in range(3):
        await pilot.press("space")
        await wait_idle(pilot, app)
    app.clear_notifications()
    await pilot.pause(0.2)
    assert_facts(app, screen_text(app), tuple(app.size))


@pytest.mark.parametrize("theme", ["kvtui-dark", "kvtui-light"])
@pytest.mark.parametrize(
    "size", [(80, 24), (120, 36), (160, 48), (240, 60)], ids=["80x24", "120x36", "160x48", "240x60"]
)
def test_main_screen(snap_compare, tiny_loaded, theme, size):
    # threads pinned: the status bar says what the engine decodes on, which would otherwise follow this machine's cores
    options = {"max_new_tokens": 8, "threads": 2, "decode_threads": 1}
    app = viewers.chat(AppConfig(options=options, theme=theme), loaded=tiny_loaded("qwen2"), clock=FakeClock())
    assert snap_compare(app, terminal_size=size, run_before=three_steps)

"""The TUI's chat under `--press` (transformers 4.57 with kvpress, .venv-compat): the engine process applies the
press, the panes get the held positions, and `v` says the compression's cost, not a match."""

from __future__ import annotations

import sys
from pathlib import Path

from kvtui import viewers
from kvtui.options import AppConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ui"))  # the pilot helpers the UI tests wait with
from pilot_helpers import start, wait_for, wait_idle  # noqa: E402


async def test_the_tui_chat_under_a_press_shows_the_eviction_and_verify_says_its_cost(tiny_dir):
    options = {"press": "knorm:0.5", "mode": "completion", "max_new_tokens": 3}
    app = viewers.chat(AppConfig(model=str(tiny_dir("llama")), options=options))
    async with app.run_test(size=(140, 45)) as pilot:
        await start(pilot, app, text="Once upon a time a small grey cat lived in a large old house by the river")
        latest = app.view.latest
        fed = len(latest.buffer)
        assert all(layer.seen == fed and layer.filled < fed and layer.held for layer in latest.layers)
        assert "press knorm:0.5" in app.view.model_text
        await pilot.press("v")
        await wait_idle(pilot, app)
        await wait_for(
            pilot,
            lambda: any("uncompressed recompute" in str(n.message) for n in app._notifications),
            what="the verify notification",
        )
        note = next(str(n.message) for n in app._notifications if "uncompressed recompute" in str(n.message))
        assert "--press knorm:0.5" in note and "KL(full ‖ compressed)" in note
        codes = {d.code for d in app.view.diagnostics}
        assert codes == {"cache-evicted", "compression-cost"}, codes

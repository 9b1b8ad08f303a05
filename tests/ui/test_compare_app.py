"""The compare screen on a tiny model (three real engine processes), and the panes' words for --cache none."""

from __future__ import annotations

from pathlib import Path

from kvtui import viewers
from kvtui.engine.chat.script import Script
from kvtui.widgets.compare.step_time_plot import StepTimePlot
from kvtui.widgets.compare.strategy_lane import StrategyLane


async def test_compare_screen_runs_the_lanes_in_lockstep(tiny_dir, tmp_path):
    script = Script(turns=("Let's start by defining a variable k equal to 5. What is k?", "Now multiply k by 3."))
    options = {
        "max_new_tokens": 5,
        "max_cache_len": 128,
        "temperature": 0.0,
        "mode": "chat",
        "system": None,
        "threads": 1,
        "decode_threads": 1,
        "dtype": "float32",
        "device": "cpu",
    }
    app = viewers.compare(
        str(tiny_dir("llama")), ("none", "dynamic", "static"), options, tmp_path, script, theme_name="kvtui-projector"
    )
    async with app.run_test(size=(120, 36)) as pilot:
        for _ in range(600):
            await pilot.pause(0.1)
            if app.view.finished or app.view.outcome == 2:
                break
        assert app.view.finished and app.view.outcome == 0
        lanes = app.view.comparison.lanes
        assert [len(lane.chosen) for lane in lanes] == [len(lanes[0].chosen)] * 3  # lockstep: the same steps each
        panes = {pane.border_title: str(pane.render()) for pane in app.query(StrategyLane)}
        assert "re-reads" in panes["none"] and "tok/s" in panes["dynamic"]
        dynamic = lanes[1]
        assert f"holds {dynamic.cache_length}" in panes["dynamic"]
        verdict = str(app.query_one("#verdict #status-text").render())  # compare's status line
        assert "tokens identical: yes" in verdict and "turn 2/2" in verdict
        plot = str(app.query_one(StepTimePlot).render())
        assert "none" in plot and "dynamic" in plot and "context length" in plot
    for strategy in ("none", "dynamic", "static"):
        assert (Path(tmp_path) / f"compare-{strategy}.jsonl").exists()


def test_cursor_and_layers_panes_say_there_is_no_cache():
    from kvtui.engine.records.snapshot import BufferToken, StepSnapshot, TokenBuffer
    from kvtui.widgets.step.cursor_pane import has_alarm, render_cursor
    from kvtui.widgets.step.layers_pane import render_totals

    tokens = [BufferToken(position=i, id=i, piece="a", special=False, origin="user", turn=1) for i in range(7)]
    snap = StepSnapshot(
        step=3,
        phase="decode",
        turn=1,
        input_ids=(6,),
        positions=(6,),
        cursor=7,
        cache_seq_length=0,
        capacity=None,
        layers=(),
        topk=(),
        topk_processed=(),
        watched=(),
        chosen=None,
        chosen_forced=False,
        diagnostics=(),
        forward_ms=2.0,
        snapshot_ms=0.1,
        buffer=TokenBuffer(tokens),
        uncached=True,
    )
    assert not has_alarm(snap)  # cursor 7, cache length 0: no cache, not a mismatch
    assert "no cache: full forward over 7 tokens" in render_cursor(snap).plain
    assert "no cache (--cache none)" in render_totals(snap).plain and "all 7 tokens" in render_totals(snap).plain

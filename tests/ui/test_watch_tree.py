"""`kvtui watch -- torchrun ...` in the TUI (Pilot): both ranks of a tensor-parallel run start held before
their first forward; one step lets each rank through exactly one forward (the same boundary: the collective
forward needs both); quitting mid-run leaves no process of the tree behind."""

import asyncio
import os
import sys
from pathlib import Path

from kvtui import viewers
from kvtui.engine.watch.tree_source import TreeSource
from pilot_helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]
TP_LOOP = ROOT / "samples" / "programs" / "tp_loop.py"


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in state


async def test_pause_a_two_rank_run_step_once_and_quit(tiny_dir):
    model = tiny_dir("llama")  # 2 KV heads: one per rank
    torchrun = str(Path(sys.executable).parent / "torchrun")
    source = TreeSource(
        torchrun, ["--standalone", "--nproc-per-node", "2", str(TP_LOOP), str(model), "100000"], paused=True
    )
    app = viewers.watch(source=source, title="torchrun tp_loop.py", paused=True)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(pilot, lambda: len(source.server.runs) == 2, 120, "both ranks to connect")
        await pilot.pause(3.0)  # held: no forward while paused
        assert app.view.latest is None and source.running
        pids = [run.pid for run in source.server.runs]
        await pilot.press("space")
        await wait_for(
            pilot, lambda: app.view.latest is not None and app.view.latest.step == 2, 60, "one forward per rank"
        )
        await pilot.pause(2.0)
        steps = app.view.driver.replay.snapshots
        assert len(steps) == 2 and {s.phase for s in steps} == {"prefill"}  # exactly one forward each
        assert sorted(s.model for s in steps) == sorted(run.name for run in source.server.runs)
        assert all(layer.k_shape[1] == 1 for s in steps for layer in s.layers)  # each rank: 1 of 2 KV heads
        await pilot.press("space")
        await wait_for(pilot, lambda: app.view.latest.step == 4, 60, "one more forward per rank")
        await pilot.pause(1.5)
        assert len(app.view.driver.replay.snapshots) == 4 and {
            s.phase for s in app.view.driver.replay.snapshots[2:]
        } == {"decode"}
        # both held after the same forward: verify runs on every rank (each recompute is a collective forward)
        await pilot.press("v")

        def verified():
            return [r for run in source.server.runs for r in run.records if r["type"] == "verify"]

        await wait_for(pilot, lambda: len(verified()) == 2, 60, "a verify result from each rank")
        assert all(r["ok"] and r["tokens"] == app.view.latest.cache_seq_length for r in verified())
        await pilot.press("q")
    launcher = source.process.pid
    for _ in range(100):  # up to 10 s
        if all(map(_gone, [launcher, *pids])):
            break
        await asyncio.sleep(0.1)
    left = [pid for pid in [launcher, *pids] if not _gone(pid)]
    for pid in left:
        os.kill(pid, 9)
    assert not left, f"left running after q: {left}"


async def test_ranks_that_feed_different_tokens_raise_rank_desync_live(tmp_path, tiny_dir, tp_loop_with):
    program = tmp_path / "tp_desync.py"
    program.write_text(
        tp_loop_with(
            "if int(os.environ.get('RANK', '0')) == 1:\n    ids[0, 2] = (ids[0, 2] + 1) % model.config.vocab_size",
            "cache = DynamicCache(config=model.config)",
        )
    )
    torchrun = str(Path(sys.executable).parent / "torchrun")
    source = TreeSource(torchrun, ["--standalone", "--nproc-per-node", "2", str(program), str(tiny_dir("llama")), "3"])
    app = viewers.watch(source=source, title="torchrun tp_desync.py")
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(pilot, lambda: app.view.driver.ended is not None, 120, "the run to end")
        await pilot.pause(0.5)
        desync = [d for d in app.view.diagnostics if d.code == "rank-desync"]
        assert len(desync) == 1 and "fed ids" in desync[0].message and desync[0].severity == "error"
        assert len(app.view.driver.replay.snapshots) == 6  # 3 forwards per rank
        await pilot.press("q")

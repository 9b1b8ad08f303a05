"""`kvtui replay --follow` as a person uses it around a program they run and run again: the viewer opened
before the program created its trace waits for it and says so; a rerun that rewrites the trace (truncated in
place, or replaced) is followed again from its first step, and the viewer says so."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvtui import viewers
from pilot_helpers import wait_for

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "seed-conversation.trace.jsonl"


def run(lines: list[bytes], steps: int, number: int) -> bytes:
    """The sample's header and first `steps` steps as run `number` wrote them: each record tagged with its run,
    as each run's own timings make a rerun's bytes differ."""
    return b"".join(json.dumps({**json.loads(line), "run": number}).encode() + b"\n" for line in lines[: steps + 1])


def kept_notes(app) -> list[str]:
    """Every note the app posts, as it posts it: a Textual notification leaves the screen after its timeout, which
    under load came before the test looked (a full make test saw one "was rewritten" of two)."""
    posted: list[str] = []
    notify = app.notify

    def keep(message, **kwargs):
        posted.append(str(message))
        notify(message, **kwargs)

    app.notify = keep
    return posted


async def test_follow_waits_for_the_trace_then_starts_again_when_it_is_rewritten(tmp_path):
    lines = SAMPLE.read_bytes().splitlines(keepends=True)
    trace = tmp_path / "run.jsonl"
    app = viewers.replay(trace, follow=True)  # the program has not run yet
    notes = kept_notes(app)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_for(pilot, lambda: any(f"waiting for {trace}" in n for n in notes), 10, "the waiting note")
        trace.write_bytes(run(lines, 20, 1))  # the first run: its header and 20 steps
        await wait_for(pilot, lambda: len(app.view.driver.replay) == 20, 30, "20 steps read")
        await wait_for(pilot, lambda: app.view.latest is not None and app.view.latest.step == 20, 30, "step 20")
        await pilot.pause(0.5)  # the follower has read all there is, and waits
        with open(trace, "wb") as handle:  # run again: the trace is rewritten in place, longer than before
            handle.write(run(lines, 30, 2))
        await wait_for(pilot, lambda: any("was rewritten" in n for n in notes), 10, "the rewritten note")
        await wait_for(pilot, lambda: app.view.latest.step == 30, 30, "the new run's step 30")
        assert [s.step for s in app.view.driver.replay.snapshots] == list(range(1, 31))  # from its first step
        await pilot.pause(0.5)
        fresh = tmp_path / "fresh.jsonl"
        fresh.write_bytes(run(lines, 5, 3))
        os.replace(fresh, trace)  # run again, writing a new file under the name: shorter
        await wait_for(pilot, lambda: len(app.view.driver.replay) == 5, 10, "the third run's 5 steps")
        await wait_for(pilot, lambda: app.view.latest.step == 5, 10, "step 5 shown")
        assert sum("was rewritten" in n for n in notes) == 2
        await pilot.press("q")

"""Soak: 2,000 forward steps in run mode in the real app on a tiny model, then check nothing grew with them,
in the app's process (snapshots, objects, tensors, threads, files) and in its engine process (RSS).

What may grow with the step count: the KV cache (2 layers x K,V x 2 KV heads x 16 dims x 4 bytes =
512 B per token on tiny qwen2), the session's token list (one BufferToken per token), the chat
transcript (the random model's greedy reply is one "\\n" per token, so one screen line per step), the
trace spool on disk, and Textual's own LRU render caches until they are full. What must not: the
in-memory snapshot history (HISTORY_STEPS), the status bar's sparklines, live StepSnapshot objects,
kvtui objects that no live snapshot holds, tensors, threads and file handles.

Both measurements are taken paused (engine idle, message queue drained), at step ~500 and at the end.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import time
from collections import Counter

import psutil
import torch
from textual.widgets import Input, Sparkline

from kvtui import viewers
from kvtui.drivers.chat import HISTORY_STEPS
from kvtui.engine.records.snapshot import BufferToken, StepSnapshot
from kvtui.options import AppConfig
from kvtui.widgets.shared import status_bar
from kvtui.widgets.shared.status_bar import StatusBar

STEPS = 2000
EARLY = 500  # first measurement: allocator settled, history (mostly) full
SOAK_TIMEOUT = 240.0  # seconds for the whole run: ~20 s here with one torch thread (~100 s with two)

# Snapshots alive besides the history: app.view.latest, app.view.driver.meter.prefill, session.last, the panes' current
# snapshot (buffer, cursor, layers, top-k), and the one a finished worker's frame may still hold.
SNAPSHOT_SLACK = 16

# RSS bytes per step between step ~500 and the end: measured 5-10 KiB/step here (more when the engine is
# slower, since each paint adds entries to Textual's caches). Legitimate: 0.5 KiB of KV cache and ~0.1 KiB
# of BufferToken per token, ~4-5 KiB per transcript line (the chat pane re-wraps the whole reply in one
# Static, and this reply is one line per token), and Textual's DataTable LRU caches (top-k, layers)
# filling up to their caps (10,000 cells, 1,000 lines each), which reach ~6 KiB/step over 1,500 steps at
# worst. The bound is a backstop for memory Python cannot see: retaining the KV cache (or a view of its
# storage) per step costs O(tokens) per step: 0.5 KiB x ~1,250 tokens on average over this run, ~20x
# the bound. Small per-step retention (a 2 KiB logits tensor, a ~3 KiB snapshot) is below any
# RSS bound that survives allocator noise: the exact object and tensor counts below catch those.
MAX_BYTES_PER_STEP = 32 * 1024

# kvtui objects (snapshots' parts, top tokens, diagnostics...) that no live snapshot holds and that
# are not the session's BufferTokens: session.pending, a watched token, the worker's locals.
MAX_ORPHANS = 64
MAX_NEW_TENSORS = 8  # the cache's K/V tensors are replaced, not added; logits are replaced per step

SCAN = ("kvtui", "transformers", "torch")


async def wait_for(pilot, predicate, timeout: float, what: str):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await pilot.pause(0.05)


def engine_busy(app) -> bool:
    return app.view.engine_busy


def _is_kvtui(kind: type) -> bool:
    module = getattr(kind, "__module__", None)  # a metatype's __module__ can be a descriptor
    return isinstance(module, str) and module.startswith("kvtui.")


def measure(app, before: frozenset[int] = frozenset()) -> dict:
    """RSS, live snapshots, tensors and kvtui objects no snapshot holds (type() checks: no __class__ lookups).
    `before`: ids of kvtui objects alive before the app started (module constants such as the tiny-model
    specs), which are not the app's doing."""
    gc.collect()
    objects = gc.get_objects()
    snapshots = [o for o in objects if type(o) is StepSnapshot]
    held: set[int] = set()
    frontier: list = list(snapshots)
    while frontier:  # kvtui objects reachable from a live snapshot (the buffer's token list aside)
        found = []
        for obj in frontier:
            for ref in gc.get_referents(obj):
                if id(ref) in held or type(ref) is BufferToken:
                    continue
                if _is_kvtui(type(ref)) or type(ref) in (tuple, list):
                    if type(ref) is list and len(ref) > 1000:  # the session's token list
                        continue
                    held.add(id(ref))
                    found.append(ref)
        frontier = found
    kinds = Counter(
        type(o).__qualname__
        for o in objects
        if _is_kvtui(type(o))
        and type(o) not in (StepSnapshot, BufferToken)
        and id(o) not in held
        and id(o) not in before
    )
    return {
        "step": app.view.session.steps,
        "rss": psutil.Process().memory_info().rss,
        "engine_rss": psutil.Process(app.view.session.pid).memory_info().rss,
        "snapshots": len(snapshots),
        "buffer_tokens": sum(1 for o in objects if type(o) is BufferToken),
        "orphans": sum(kinds.values()),
        "orphan_kinds": dict(kinds),
        "tensors": sum(1 for o in objects if issubclass(type(o), torch.Tensor)),
        "history": len(app.view.driver.history),
    }


def busy_threads() -> list[str]:
    """Threads (other than this one) whose stack runs kvtui, transformers or torch code."""
    frames = sys._current_frames()
    found = []
    for thread in threading.enumerate():
        if thread is threading.current_thread():
            continue
        frame = frames.get(thread.ident)
        while frame is not None:
            name = frame.f_code.co_filename.replace(os.sep, "/")
            if any(f"/{part}/" in name for part in SCAN):
                found.append(f"{thread.name}: {name}:{frame.f_lineno}")
                break
            frame = frame.f_back
    return found


async def run_until(pilot, app, steps: int, turns: list[int]) -> None:
    """Press r and wait for `steps` forwards; a turn that ends early (an end token) gets another turn."""
    await pilot.press("r")
    while app.view.session.steps < steps:
        await wait_for(
            pilot,
            lambda: app.view.session.steps >= steps or not engine_busy(app),
            SOAK_TIMEOUT,
            f"{steps} steps (at {app.view.session.steps})",
        )
        if app.view.session.steps < steps and not engine_busy(app):
            assert len(turns) < 20, "generation keeps stopping: the soak cannot reach its step count"
            turns.append(app.view.session.steps)
            chat_input = app.query_one("#message", Input)
            chat_input.focus()
            chat_input.value = f"Tell me more, part {len(turns)}."
            await pilot.press("enter")
            await wait_for(pilot, lambda: not engine_busy(app), 60, "the next prefill")
            await pilot.press("r")
            await pilot.pause(0.05)
    await pilot.press("p")
    await wait_for(pilot, lambda: not engine_busy(app), 60, "the pause")
    await wait_for(pilot, lambda: app.view._paint_timer is None, 10, "the last repaint")
    await pilot.pause(0.2)


async def test_two_thousand_steps_in_run_mode_keep_memory_threads_and_files_bounded(tiny_loaded, one_torch_thread):
    loaded = tiny_loaded("qwen2")  # built first: building starts tqdm's monitor thread
    process = psutil.Process()
    gc.collect()
    constants = frozenset(id(o) for o in gc.get_objects() if _is_kvtui(type(o)))
    threads_before = {t.ident for t in threading.enumerate()}
    files_before = {f.path for f in process.open_files()}
    # one torch thread in the engine process too (the fixture sets this process's)
    app = viewers.chat(AppConfig(options={"max_new_tokens": STEPS, "threads": 1}), loaded=loaded)

    async with app.run_test(size=(140, 45)) as pilot:
        await wait_for(pilot, lambda: app.view.session is not None, 60, "the model to load")
        spool = app.view.driver.source.trace_path
        assert app.view.driver.source.spooled and spool.exists()
        app.view.step_mode = True  # Enter only prefills; "r" runs the turn
        chat_input = app.query_one("#message", Input)
        chat_input.focus()
        chat_input.value = "What is k?"
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.view.latest is not None and not engine_busy(app), 60, "the prefill")
        turns = [1]
        await run_until(pilot, app, EARLY, turns)
        early = measure(app, constants)
        # the pause lands some steps after EARLY on a busy machine: measure the same window after it
        await run_until(pilot, app, max(STEPS, early["step"] + STEPS - EARLY), turns)
        late = measure(app, constants)
        steps = app.view.session.steps
        assert steps >= STEPS and app.view.latest.step == steps

        # the history and the sparklines are capped; the trace spool holds every step
        assert app.view.driver.history.maxlen == HISTORY_STEPS and len(app.view.driver.history) == HISTORY_STEPS
        kept = [s.step for s in app.view.driver.history]  # every step: repaints coalesce, the history does not
        assert kept == list(range(steps - HISTORY_STEPS + 1, steps + 1))
        bar = app.query_one(StatusBar)
        for points in (bar.latency, bar.cache_size):
            assert points.maxlen == status_bar.HISTORY and len(points) == status_bar.HISTORY
        for sparkline in app.query(Sparkline):
            assert len(sparkline.data or ()) <= status_bar.HISTORY
        assert app.view._recent_ms.maxlen is not None and len(app.view._recent_ms) <= app.view._recent_ms.maxlen
        with open(spool, encoding="utf-8") as handle:
            step_lines = sum(1 for line in handle if line.startswith('{"type":"step"'))
        assert step_lines == steps

        # memory: snapshots capped, nothing kvtui-made outside them accumulates, tensors constant, RSS bounded
        for point in (early, late):
            assert point["snapshots"] <= HISTORY_STEPS + SNAPSHOT_SLACK, point
            assert point["orphans"] <= MAX_ORPHANS, point
        assert late["buffer_tokens"] <= len(app.view.session.buffer) + SNAPSHOT_SLACK, late
        assert late["tensors"] - early["tensors"] <= MAX_NEW_TENSORS, (early, late)
        span = late["step"] - early["step"]
        assert span >= 1000, (early, late)
        rss_per_step = (late["rss"] - early["rss"]) / span
        assert rss_per_step < MAX_BYTES_PER_STEP, (early, late)
        engine_per_step = (late["engine_rss"] - early["engine_rss"]) / span
        assert engine_per_step < MAX_BYTES_PER_STEP, (early, late)
        print(
            f"\nsoak: {steps} steps, turns started at {turns}; step {early['step']} -> {late['step']}: "
            f"RSS {rss_per_step / 1024:+.2f} KiB/step ({(late['rss'] - early['rss']) / 2**20:+.1f} MiB), engine "
            f"process {engine_per_step / 1024:+.2f} KiB/step; "
            f"live StepSnapshots {early['snapshots']} -> {late['snapshots']} (history {early['history']} -> "
            f"{late['history']}); orphan kvtui objects {early['orphans']} -> {late['orphans']} "
            f"{late['orphan_kinds']}; BufferTokens {early['buffer_tokens']} -> {late['buffer_tokens']} "
            f"(buffer {len(app.view.session.buffer)}); tensors {early['tensors']} -> {late['tensors']}; "
            f"diagnostics {len(app.view.diagnostics)}, app_diagnostics {len(app.view.app_diagnostics)}"
        )

    # after exit: no thread still runs the engine, no new thread but idle executor threads, no open file. The
    # engine's pipe readers end as its pipes close, a moment after the process (CI saw one still reading)
    ended = time.monotonic() + 3.0
    while busy_threads() and time.monotonic() < ended:
        time.sleep(0.05)
    assert busy_threads() == []
    new_threads = [t.name for t in threading.enumerate() if t.ident not in threads_before and t.is_alive()]
    assert all(name.startswith("asyncio_") for name in new_threads), new_threads
    assert not spool.exists()
    assert {f.path for f in process.open_files()} - files_before == set()  # earlier tests' files may close meanwhile

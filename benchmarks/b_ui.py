"""4. UI: token pane apply + repaint at 1k/10k/100k tokens, time to first frame (subprocess), key
latency while the model runs, and tokens/s of the TUI's run mode vs the headless engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

from common import ROOT, log, summary
from engine_hooks import read_stamps, reply_decodes
from engine_hooks import stamps as stamp_hook
from kvtui.engine.chat.host import EngineSource
from kvtui.engine.records.child import ENGINE_SPIN_COUNT

PANE_SIZE = (160, 48)
APP_SIZE = (160, 48)

# ---- the token pane ---------------------------------------------------------------------------------

WORDS = [
    "The",
    " cache",
    " holds",
    " every",
    " token",
    ",",
    " and",
    " its",
    " position",
    ".",
    "\n",
    " k",
    " =",
    " 5",
    " multiplied",
    " by",
    " 11",
    " is",
    " 55",
    "?",
    " Let",
    "'s",
    " start",
    "<|im_start|>",
    "<|im_end|>",
    "user",
    "assistant",
    " 🙂",
    "\t",
    " résumé",
    " 変数",
]
ORIGIN_CYCLE = ["template", "system", "user", "user", "assistant", "assistant", "assistant", "forced"]


def synthetic_tokens(count: int):
    from kvtui.engine.records.snapshot import BufferToken

    tokens = []
    for i in range(count):
        piece = WORDS[(i * 7) % len(WORDS)]
        special = piece.startswith("<|")
        origin = "template" if special else ORIGIN_CYCLE[(i // 13) % len(ORIGIN_CYCLE)]
        tokens.append(
            BufferToken(position=i, id=(i * 31) % 49152, piece=piece, special=special, origin=origin, turn=i // 500)
        )
    return tokens


def synthetic_snapshot(tokens, length: int, step: int):
    from kvtui.engine.records.snapshot import LayerInfo, StepSnapshot, TokenBuffer, TopToken

    layers = tuple(
        LayerInfo(
            index=i,
            kind="full",
            k_shape=(1, 3, length, 64),
            v_shape=(1, 3, length, 64),
            dtype="float32",
            device="cpu",
            bytes=2 * 3 * length * 64 * 4,
            filled=length,
            capacity=None,
            window=None,
            seen=length,
            held_from=0,
        )
        for i in range(30)
    )
    chosen = TopToken(id=42, text=" next", logit=12.5, prob=0.61, rank=1)
    return StepSnapshot(
        step=step,
        phase="decode",
        turn=length // 500,
        input_ids=(tokens[length - 1].id,),
        positions=(length - 1,),
        cursor=length,
        cache_seq_length=length,
        capacity=None,
        layers=layers,
        topk=(chosen,),
        topk_processed=(chosen,),
        watched=(),
        chosen=chosen,
        chosen_forced=False,
        diagnostics=(),
        forward_ms=60.0,
        snapshot_ms=1.0,
        buffer=TokenBuffer(tokens, length),
        turn_done=False,
    )


async def _after_refresh(widget) -> None:
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    widget.call_after_refresh(lambda: done.done() or done.set_result(None))
    await asyncio.wait_for(done, 10)


async def _pane_bench(sizes: list[int], repeats: int) -> dict:
    from textual.app import App

    from kvtui.widgets.step.token_buffer import TokenBufferPane

    class PaneHost(App):
        def compose(self):
            yield TokenBufferPane(id="buffer")

    tokens = synthetic_tokens(max(sizes) + repeats + 8)
    app = PaneHost()
    out = {}
    async with app.run_test(size=PANE_SIZE) as pilot:
        pane = app.query_one(TokenBufferPane)
        for n in sizes:
            pane.show(synthetic_snapshot(tokens, n, 1))  # warm: styles, grid, lru caches
            await pilot.pause()
            await _after_refresh(pane)
            show_us, lines_ms, both_ms, cycle_ms, cycle_cpu_ms = [], [], [], [], []
            height = pane.scrollable_content_region.height
            for r in range(repeats):
                snap = synthetic_snapshot(tokens, n + 1 + r, r + 2)  # one token more per step, as in decode
                t0 = time.perf_counter()
                pane.show(snap)
                t1 = time.perf_counter()
                for y in range(height):
                    pane.render_line(y)
                t2 = time.perf_counter()
                show_us.append((t1 - t0) * 1e6)
                lines_ms.append((t2 - t1) * 1000)
                both_ms.append((t2 - t0) * 1000)
                # the real repaint: show() then the app's next screen refresh (compositor, styles, output)
                snap = synthetic_snapshot(tokens, n + 2 + r, r + 2)
                await asyncio.sleep(0)
                c0, w0 = time.process_time(), time.perf_counter()
                pane.show(snap)
                await _after_refresh(pane)
                cycle_ms.append((time.perf_counter() - w0) * 1000)
                cycle_cpu_ms.append((time.process_time() - c0) * 1000)
            visible = pane.visible_range()
            out[n] = {
                "show_us": summary(show_us),
                "render_visible_ms": summary(lines_ms),
                "show_plus_render_ms": summary(both_ms),
                "refresh_cycle_ms": summary(cycle_ms),
                "refresh_cycle_cpu_ms": summary(cycle_cpu_ms),
                "visible_lines": height,
                "visible_tokens": len(visible),
                "tail_visible": visible.stop >= n,
            }
            log(
                f"  pane {n} tokens: show {out[n]['show_us']['median']:.0f} us, show+render {height} lines "
                f"{out[n]['show_plus_render_ms']['median']:.2f} ms, refresh cycle "
                f"{out[n]['refresh_cycle_ms']['median']:.2f} ms wall / "
                f"{out[n]['refresh_cycle_cpu_ms']['median']:.2f} ms CPU"
            )
    return out


def bench_pane(sizes=(1000, 10000, 100000), repeats: int = 30) -> dict:
    return asyncio.run(_pane_bench(list(sizes), repeats))


# ---- time to first frame (fresh interpreter) --------------------------------------------------------

FIRST_FRAME_CHILD = r"""
import os, sys, time
t_start = time.time()
import kvtui.app, kvtui.screens.step, kvtui.drivers.chat  # the app and its step viewer on kvtui's own chat
t_import = time.time()
torch_imported = "torch" in sys.modules
transformers_imported = "transformers" in sys.modules
from kvtui.app import KvtuiApp
from kvtui.drivers.chat import ChatDriver
from kvtui.screens.step import StepScreen

out_path, model_dir = sys.argv[1], sys.argv[2]

class FirstFrame(KvtuiApp):
    def on_mount(self):
        self.call_after_refresh(self._first_frame)

    def _first_frame(self):
        import json
        t = time.time()
        loaded = self.view.session is not None
        with open(out_path, "w") as f:
            json.dump({"start": t_start, "imported": t_import, "constructed": t_constructed, "frame": t,
                       "torch_at_import": torch_imported, "transformers_at_import": transformers_imported,
                       "model_loaded_at_frame": loaded}, f)
        os._exit(0)  # the model loader thread is still importing/loading: do not wait for it

from kvtui.options import AppConfig
config = AppConfig(model=model_dir)
app = FirstFrame(StepScreen(config, ChatDriver(config)), theme=config.theme)
t_constructed = time.time()
app.run(headless=True, size=(160, 48))
"""

IMPORT_CHILD = r"""
import sys, time, json
t0 = time.time()
import torch
t1 = time.time()
import transformers
from transformers import DynamicCache
t2 = time.time()
import textual.app, textual.widgets
t3 = time.time()
print(json.dumps({"torch": t1 - t0, "transformers": t2 - t1, "textual": t3 - t2}))
"""


def bench_first_frame(model_dir: Path, repeats: int = 3) -> dict:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    rows = []
    for _ in range(repeats + 1):  # the first run warms the OS file cache; discarded
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "frame.json"
            t0 = time.time()
            proc = subprocess.run(
                [sys.executable, "-c", FIRST_FRAME_CHILD, str(out), str(model_dir)],
                env=env,
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=120,
            )
            t_exit = time.time()
            if not out.exists():
                raise RuntimeError(f"first-frame child failed: {proc.stderr[-2000:]}")
            data = json.loads(out.read_text())
        rows.append(
            {
                "interpreter_ms": (data["start"] - t0) * 1000,
                "import_ms": (data["imported"] - data["start"]) * 1000,
                "construct_ms": (data["constructed"] - data["imported"]) * 1000,
                "mount_to_frame_ms": (data["frame"] - data["constructed"]) * 1000,
                "spawn_to_frame_ms": (data["frame"] - t0) * 1000,
                "exit_ms": (t_exit - t0) * 1000,
                "torch_at_import": data["torch_at_import"],
                "transformers_at_import": data["transformers_at_import"],
                "model_loaded_at_frame": data["model_loaded_at_frame"],
            }
        )
    rows = rows[1:]
    split = []
    for _ in range(repeats):
        proc = subprocess.run(
            [sys.executable, "-c", IMPORT_CHILD], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        split.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    result = {
        key: summary([r[key] for r in rows])
        for key in ("interpreter_ms", "import_ms", "construct_ms", "mount_to_frame_ms", "spawn_to_frame_ms")
    }
    result["torch_at_import"] = all(r["torch_at_import"] for r in rows)
    result["transformers_at_import"] = all(r["transformers_at_import"] for r in rows)
    result["model_loaded_at_frame"] = any(r["model_loaded_at_frame"] for r in rows)
    result["import_torch_ms"] = summary([s["torch"] * 1000 for s in split])
    result["import_transformers_ms"] = summary([s["transformers"] * 1000 for s in split])
    result["import_textual_ms"] = summary([s["textual"] * 1000 for s in split])
    log(
        f"  first frame: spawn->frame {result['spawn_to_frame_ms']['median']:.0f} ms (import kvtui.app "
        f"{result['import_ms']['median']:.0f} ms, torch imported by it: {result['torch_at_import']})"
    )
    return result


# ---- the real app: run mode speed, key latency ------------------------------------------------------


def _engine_busy(app) -> bool:
    return app.view.engine_busy


async def _wait(predicate, timeout: float, poll: float = 0.001) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(poll)
    return True


def _send_key(app, key: str, char: str | None) -> None:
    """What Pilot.press does, minus its wait-for-idle (which waits up to 1 s while the model runs)."""
    from textual import events

    event = events.Key(key, char)
    event.set_sender(app)
    app._driver.send_message(event)


def decode_rate(stamps: list[tuple[float, str, int]]) -> tuple[float, int]:
    """tokens/s from the first decode step to the last one of the turn (the same rule for every variant)."""
    decode = [t for t, phase, _ in stamps if phase == "decode"]
    if len(decode) < 2:
        return float("nan"), len(decode)
    return (len(decode) - 1) / (decode[-1] - decode[0]), len(decode)


def headless_rate(loaded, prompt: str, n_new: int, options: dict | None = None) -> tuple[float, int]:
    """The engine without any UI, in this process: ChatSession.generate, stamped per forward, with the session
    options `kvtui --headless` builds (its decode threads among them) plus `options`."""
    from kvtui.engine.chat.session import ChatSession
    from kvtui.options import build_session_config

    stamps: list[tuple[float, str, int]] = []
    config = build_session_config({"max_new_tokens": n_new, **(options or {})}, loaded.tokenizer)
    session = ChatSession(
        loaded.model,
        loaded.tokenizer,
        config,
        on_snapshot=lambda s: stamps.append((time.perf_counter(), s.phase, s.step)),
    )
    session.stop_ids = frozenset()
    session.send(prompt)
    session.generate()
    return decode_rate(stamps)


async def _tui_round(
    loaded, prompt: str, n_new: int, profile_out: Path | None = None, key_tests: bool = False, key_repeats: int = 5
) -> dict:
    """A fresh app; its engine process gets the same loaded model (pickled) and stamps every forward."""
    from textual.widgets import Input

    from kvtui import viewers
    from kvtui.options import AppConfig

    with tempfile.TemporaryDirectory() as tmp:
        stamp_file = Path(tmp) / "stamps.txt"
        app = viewers.chat(
            AppConfig(options={"max_new_tokens": n_new if not key_tests else 10**6}),
            loaded=loaded,
            engine_setup=stamp_hook(stamp_file),
        )
        stamps = lambda: read_stamps(stamp_file)  # noqa: E731
        result: dict = {}
        async with app.run_test(size=APP_SIZE) as pilot:
            await _wait(lambda: app.view.session is not None, 120, 0.01)
            app.view.step_mode = False
            box = app.query_one("#message", Input)
            box.focus()
            box.value = prompt
            spy = None
            t_send = time.perf_counter()
            _send_key(app, "enter", "\r")
            if profile_out is not None:
                await _wait(lambda: app.view.latest is not None and app.view.latest.phase == "decode", 60, 0.005)
                spy = subprocess.Popen(
                    [
                        "py-spy",
                        "record",
                        "--pid",
                        str(os.getpid()),
                        "--rate",
                        str(PROFILE_RATE),
                        "--threads",
                        "--format",
                        "raw",
                        "--duration",
                        str(PROFILE_SECONDS),
                        "--output",
                        str(profile_out),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            if key_tests:
                result.update(await _key_latencies(app, stamps, key_repeats))
                _send_key(app, "p", "p")
                await _wait(lambda: not _engine_busy(app), 60, 0.005)
            else:
                await _wait(lambda: app.view.latest is not None and app.view.latest.phase == "decode", 60, 0.01)
                await _wait(lambda: not _engine_busy(app), 600, 0.01)
            if spy is not None:
                try:
                    _, err = spy.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    spy.kill()
                    err = "timeout"
                result["profile_rc"] = spy.returncode
                result["profile_err"] = (err or "")[-500:]
            await _wait(lambda: getattr(app, "_paint_timer", None) is None, 5, 0.01)
            await pilot.pause()
            got = stamps()
            rate, n = decode_rate(got)
            result.update(
                {
                    "tps": rate,
                    "decode_tokens": n,
                    "reply_decodes": reply_decodes(stamp_file),
                    "send_to_first_ms": (got[0][0] - t_send) * 1000 if got else float("nan"),
                }
            )
            await pilot.pause()
    return result


async def _key_latencies(app, stamps, repeats: int) -> dict:
    """While the model runs: F5 (toggle the layers pane) -> display flipped / next screen refresh; p (pause)
    -> the engine answered that its turn stopped; r resumes between pause tests. Then, paused, in step mode:
    space -> the new step painted."""
    layers = app.query_one("#layers")
    toggle_handled, toggle_painted, pause_ms, steps_after, step_painted = [], [], [], [], []
    await _wait(lambda: len(stamps()) > 5, 60, 0.005)
    for i in range(repeats * 2):
        before = layers.display
        t0 = time.perf_counter()
        _send_key(app, "f5", None)
        await _wait(lambda before=before: layers.display != before, 10)
        t1 = time.perf_counter()
        await _after_refresh(app.screen)
        t2 = time.perf_counter()
        toggle_handled.append((t1 - t0) * 1000)
        toggle_painted.append((t2 - t0) * 1000)
        await asyncio.sleep(0.15 + 0.05 * (i % 3))  # de-phase from the 2 Hz repaint timer
    for i in range(repeats):
        await _wait(lambda: _engine_busy(app), 10, 0.005)
        await asyncio.sleep(0.2 + 0.07 * i)
        step_at = len(stamps())
        t0 = time.perf_counter()
        _send_key(app, "p", "p")
        await _wait(lambda: not _engine_busy(app), 30)  # the engine's "state" record for the stopped turn
        pause_ms.append((time.perf_counter() - t0) * 1000)
        steps_after.append(len(stamps()) - step_at)
        _send_key(app, "r", "r")
        await _wait(lambda step_at=step_at: len(stamps()) > step_at + 3, 30, 0.005)
    _send_key(app, "p", "p")
    await _wait(lambda: not _engine_busy(app), 30)
    app.view.step_mode = True
    await asyncio.sleep(0.6)  # the last throttled repaint
    for _ in range(repeats * 2):
        before = app.view.latest.step
        t0 = time.perf_counter()
        _send_key(app, "space", " ")
        await _wait(lambda before=before: app.view.latest.step > before and app.view._paint_timer is None, 30)
        await _after_refresh(app.screen)
        step_painted.append((time.perf_counter() - t0) * 1000)
        await _wait(lambda: not _engine_busy(app), 30)
        await asyncio.sleep(0.1)
    return {
        "toggle_handled_ms": summary(toggle_handled),
        "toggle_painted_ms": summary(toggle_painted),
        "pause_ms": summary(pause_ms),
        "forwards_after_pause": summary(steps_after),
        "step_painted_ms": summary(step_painted),
        "step_ms": summary(
            [(b - a) * 1000 for (a, pa, _), (b, pb, _) in zip(stamps(), stamps()[1:]) if pa == pb == "decode"]
        ),
    }


def bench_keys(loaded, prompt: str, repeats: int = 5) -> dict:
    result = asyncio.run(_tui_round(loaded, prompt, 0, key_tests=True, key_repeats=repeats))
    return result


REFRESH_HZ_OF = {
    "tui_no_paint": 1e-9,
    "tui_1hz": 1,
    "tui_unthrottled": 1_000_000,
}  # the app's variants; others as shipped


OPENMP_WAIT_OF = {"omp_default": "", "passive": "PASSIVE"}  # OMP_WAIT_POLICY for an app kind's engine


@contextlib.contextmanager
def engine_openmp_wait(kind: str):
    """Engine processes started here wait as the app kind says: as shipped (kvtui's short spin), "passive"
    (OMP_WAIT_POLICY=PASSIVE) or "omp_default" (libgomp's default: an empty OMP_WAIT_POLICY is a user's setting
    to kvtui, which then sets no spin count, and neither policy to libgomp)."""
    saved = os.environ.get("OMP_WAIT_POLICY")
    if kind in OPENMP_WAIT_OF:
        os.environ["OMP_WAIT_POLICY"] = OPENMP_WAIT_OF[kind]
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("OMP_WAIT_POLICY", None)
        else:
            os.environ["OMP_WAIT_POLICY"] = saved


# The engines of the run-mode rounds load the embedded SmolLM2 themselves, the way `kvtui` does, with the
# options run.py loads its headless copy with: the same loader, so the weights sit in the same kind of memory
# on both sides (a model unpickled from the parent would not: anonymous pages vs the loader's own).
ENGINE_OPTIONS = {"dtype": "float32", "device": "cpu"}


class EngineOnly:
    """The engine process as the app starts it (same setup, trace spool, records over the pipe), driven from
    here with no app: what the process split costs before any pane is painted."""

    def __init__(self, n_new: int, stamp_file: Path, tmp: Path):
        import queue
        import threading

        from kvtui.engine.chat.host import EngineSetup
        from kvtui.options import AppConfig

        options = AppConfig(options={"max_new_tokens": n_new, **ENGINE_OPTIONS}).options
        setup = EngineSetup(
            model=None,
            options=options,
            trace_path=str(tmp / "engine-only.jsonl"),
            engine_setup=stamp_hook(stamp_file),
        )
        self.stamp_file = stamp_file
        self.source = EngineSource(setup)
        self.done: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._drain, name="bench-engine-records", daemon=True).start()

    def _drain(self) -> None:
        for record in self.source.records():  # parsed, as the app's pump does (no snapshot rebuilt, no panes)
            if record.get("type") in ("ready", "state", "load-failed", "process-exit"):
                self.done.put(record["type"])

    def wait(self, timeout: float = 300) -> str:
        return self.done.get(timeout=timeout)

    def turn(self, prompt: str) -> None:
        self.source.command("reset")
        self.wait()
        self.source.command("send", {"text": prompt, "run": True})
        self.wait()


class Turn(NamedTuple):
    tokens: int  # decode steps after the first
    seconds: float  # first decode step -> last, stamped where the model runs
    wall: float  # send -> the turn is done (for the app: and its last repaint)
    app_cpu: float  # CPU seconds of this process (the app's, or the idle app's while others run) over `wall`
    model_cpu: float  # CPU seconds of the process that ran the model (this one for headless)
    reply_decodes: int = 0  # full decodes of the reply the engine made for the transcript (app turns)


def _decode_span(stamp_file: Path, mark: int) -> tuple[int, float]:
    decode = [t for t, phase, _ in read_stamps(stamp_file)[mark:] if phase == "decode"]
    return len(decode) - 1, decode[-1] - decode[0]


def _cpu(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


async def _app_turn(app, pilot, stamp_file: Path, prompt: str, refresh_hz: float | None) -> Turn:
    """Reset the app's chat, send the prompt in run mode, wait for the turn and its last repaint.
    `refresh_hz` patches kvtui.screens.step.REFRESH_HZ for the turn (None: as shipped)."""
    import kvtui.screens.step as app_module

    app.view.driver.command("reset")
    await _wait(lambda: not _engine_busy(app), 30, 0.005)
    mark, decodes = len(read_stamps(stamp_file)), reply_decodes(stamp_file)
    shipped_hz = app_module.REFRESH_HZ
    app_module.REFRESH_HZ = refresh_hz or shipped_hz
    c0, m0, w0 = time.process_time(), _cpu(app.view.driver.source.pid), time.perf_counter()
    try:
        app.view.driver.command("send", prompt)
        await _wait(lambda: not _engine_busy(app), 600, 0.01)
        await _wait(lambda: app.view._paint_timer is None, 5, 0.01)
        await pilot.pause()
    finally:
        app_module.REFRESH_HZ = shipped_hz
    wall, app_cpu, model_cpu = time.perf_counter() - w0, time.process_time() - c0, _cpu(app.view.driver.source.pid) - m0
    return Turn(*_decode_span(stamp_file, mark), wall, app_cpu, model_cpu, reply_decodes(stamp_file) - decodes)


def _engine_turn(engine: EngineOnly, prompt: str) -> Turn:
    mark = len(read_stamps(engine.stamp_file))
    c0, m0, w0 = time.process_time(), _cpu(engine.source.pid), time.perf_counter()
    engine.turn(prompt)
    wall, app_cpu, model_cpu = time.perf_counter() - w0, time.process_time() - c0, _cpu(engine.source.pid) - m0
    return Turn(*_decode_span(engine.stamp_file, mark), wall, app_cpu, model_cpu)


def _headless_turn(loaded, prompt: str, n_new: int, threads: int | None = None, options: dict | None = None) -> Turn:
    import torch

    shipped = torch.get_num_threads()
    torch.set_num_threads(threads or shipped)
    c0, w0 = time.process_time(), time.perf_counter()
    try:
        rate, n = headless_rate(loaded, prompt, n_new, options)
    finally:
        torch.set_num_threads(shipped)
    cpu = time.process_time() - c0
    return Turn(n - 1, (n - 1) / rate, time.perf_counter() - w0, cpu, cpu)


async def _interleaved_round(loaded, prompt: str, n_new: int, turns: int, variants: list[str]) -> dict[str, list]:
    """The variants take turns, one short turn each, the order rotated every cycle. `loaded` is the headless
    copy of the embedded SmolLM2 (loaded with ENGINE_OPTIONS); the engines load their own.

    This VM's speed drifts by ±20 % within seconds (headless alone, back to back: 15–22 tok/s), so variants
    measured a minute apart compare the drift, not the variants; taking turns, all see the same drift. One
    runs at a time: the others' processes are idle (the headless turn and the engine-only turn block this
    process's event loop, so the apps cannot even repaint). Every turn starts from an empty chat: the apps
    and the engine get `reset`, headless a fresh session. Returns the Turns of each variant."""
    from kvtui import viewers
    from kvtui.options import AppConfig

    out: dict[str, list] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as cleanup:
        tmp = Path(tmp)
        engine = None
        if "engine" in variants:
            engine = EngineOnly(n_new, tmp / "engine-only.txt", tmp)
            cleanup.callback(engine.source.stop)
            assert engine.wait() == "ready", "the engine process did not load the model"
        apps = {}  # (app, pilot, stamp file) per kind of engine (_app_kind): as shipped, passive, OpenMP default wait,
        # 1 thread, decoding on every thread
        async with contextlib.AsyncExitStack() as stack:
            for kind in sorted({_app_kind(v) for v in variants if v.startswith("tui")}):
                stamp_file = tmp / f"app-{kind}.txt"
                options = {"max_new_tokens": n_new, **ENGINE_OPTIONS, **_app_options(kind)}
                with engine_openmp_wait(kind):
                    app = viewers.chat(AppConfig(options=options), engine_setup=stamp_hook(stamp_file))
                    pilot = await stack.enter_async_context(app.run_test(size=APP_SIZE))
                    await _wait(lambda app=app: app.view.session is not None, 120, 0.01)  # spawned inside the with
                app.view.step_mode = False
                apps[kind] = (app, pilot, stamp_file)
            for cycle in range(turns):
                for which in variants[cycle % len(variants) :] + variants[: cycle % len(variants)]:
                    if which.startswith("headless_main"):
                        out[which].append(
                            _headless_turn(
                                loaded,
                                prompt,
                                n_new,
                                1 if which.endswith("1thread") else None,
                                _app_options(which.removeprefix("headless_main_")),
                            )
                        )
                    elif which == "engine":
                        out[which].append(_engine_turn(engine, prompt))
                    else:
                        app, pilot, stamp_file = apps[_app_kind(which)]
                        out[which].append(await _app_turn(app, pilot, stamp_file, prompt, REFRESH_HZ_OF.get(which)))
    return out


def _app_kind(variant: str) -> str:
    kind = variant.removeprefix("tui_")
    return kind if kind in ("omp_default", "passive", "1thread", "all_threads", "keep_core") else "shipped"


def _all_threads() -> int:
    import torch

    return torch.get_num_threads()


def _app_options(kind: str) -> dict:
    """The options of an app kind's engine (beside its OpenMP wait, OPENMP_WAIT_OF), or of a headless variant; as
    shipped both decode on every thread (configure.session_config)."""
    return {
        "1thread": {"threads": 1},
        "all_threads": {"decode_threads": _all_threads()},
        "keep_core": {"decode_threads": max(1, _all_threads() - 1)},
    }.get(kind, {})


RUN_MODE_VARIANTS = ("headless_main", "engine", "tui", "tui_no_paint", "tui_all_threads", "headless_main_all_threads")


def bench_run_mode(
    loaded,
    prompt: str,
    n_new: int,
    rounds: int,
    turns: int = 3,
    profile_dir: Path | None = None,
    deadline: float | None = None,
    variants: tuple[str, ...] = RUN_MODE_VARIANTS,
) -> dict:
    """TUI run mode vs the headless engine, interleaved turn by turn (see _interleaved_round); a fresh app and
    engine processes per round. Variants (the first must be headless_main):
    - headless_main: ChatSession.generate in this process's main thread (where `kvtui --headless` runs it);
    - engine: the engine process as the app starts it, driven with no app (what the process split costs);
    - tui: KvtuiApp run mode as shipped (the engine in its own process, repaints throttled to REFRESH_HZ);
    - tui_no_paint: the same app with REFRESH_HZ patched to 1e-9 for that turn (no repaint until it ends);
    - tui_unthrottled: REFRESH_HZ patched to 1e6 for that turn (every coalesced snapshot repaints at once);
    - tui_1hz: REFRESH_HZ patched to 1 for that turn (half the shipped repaint rate);
    - tui_passive: a second app whose engine's OpenMP threads sleep at once (OMP_WAIT_POLICY=PASSIVE);
    - tui_omp_default: a third app whose engine keeps libgomp's default wait (300,000 spins, then sleep);
    - tui_1thread: an app started with --threads 1; headless_main_1thread: headless with 1 thread;
    - tui_all_threads: an app whose engine decodes on every thread (--decode-threads N), leaving no core to the app;
    - headless_main_all_threads: headless decoding on every thread (--decode-threads N);
    - tui_keep_core: an app whose engine decodes on one thread fewer (--decode-threads N-1), a core left to the app.
    A round's rate is its decode tokens over its decode seconds (first decode step to the turn's last, stamped
    where the model runs); a round's ratio is a variant's rate over headless_main's in that round."""
    import kvtui.screens.step as app_module

    headless_rate(loaded, prompt, 8)  # warm-up
    per_round: list[dict[str, float]] = []
    turn_ratios: dict[str, list[float]] = {v: [] for v in variants[1:]}
    turns_all: dict[str, list[Turn]] = {v: [] for v in variants}
    for r in range(rounds):
        if r >= 3 and deadline is not None and time.perf_counter() > deadline:
            log("  run mode: skipping further rounds (time budget)")
            break
        got = asyncio.run(_interleaved_round(loaded, prompt, n_new, turns, list(variants)))
        per_round.append({v: sum(t.tokens for t in got[v]) / sum(t.seconds for t in got[v]) for v in variants})
        for v in variants:
            turns_all[v] += got[v]
        for v in variants[1:]:  # turn by turn, each against the headless turn of its cycle
            turn_ratios[v] += [
                (t.tokens / t.seconds) / (h.tokens / h.seconds) for t, h in zip(got[v], got["headless_main"])
            ]
        log(
            f"  run mode round {r + 1}/{rounds} ({turns} turns each, interleaved): "
            + ", ".join(f"{k} {v:.2f}" for k, v in per_round[-1].items())
            + " tok/s"
        )
    result = {
        "n_new": n_new,
        "refresh_hz": app_module.REFRESH_HZ,
        "rounds": len(per_round),
        "turns": turns,
        "variants": list(variants),
        "engine_spin_count": ENGINE_SPIN_COUNT,
        "threads": _all_threads(),
        "decode_threads": _all_threads(),  # as shipped: decode on every thread, app and headless alike
        **{f"{v}_tps": summary([row[v] for row in per_round]) for v in variants},
        **{f"ratio_{v}": summary([row[v] / row["headless_main"] for row in per_round]) for v in variants[1:]},
        "turn_ratio": {v: summary(x) for v, x in turn_ratios.items()},
        # where the CPU went: the app's share of one core while a turn ran, and the CPU the model's process
        # spent per decode token (2 intra-op threads: up to 2 CPU-seconds per second; spinning counts)
        "app_cpu_share": {v: summary([t.app_cpu / t.wall for t in turns_all[v]]) for v in variants[1:]},
        "model_cpu_ms_per_token": {
            v: summary([1000 * t.model_cpu / (t.tokens + 1) for t in turns_all[v]]) for v in variants
        },
    }
    if "ratio_tui" in result:  # the shipped app measured (variants may name only the ones compared)
        result["ratio"] = result["ratio_tui"]
    # forwards of a turn: its prefill, then tokens + 1 decode steps
    result["reply_decodes_per_forward"] = summary([t.reply_decodes / (t.tokens + 2) for t in turns_all.get("tui", [])])
    if profile_dir is not None:
        raw = profile_dir / "tui-run-mode.txt"
        prof = asyncio.run(_tui_round(loaded, prompt, n_new, profile_out=raw))
        result["profiled_tps"] = prof["tps"]
        result["profile"] = (
            summarize_profile(raw, PROFILE_RATE, PROFILE_SECONDS)
            if raw.exists() and raw.stat().st_size
            else {"error": prof.get("profile_err")}
        )
        log(f"  profiled TUI round: {prof['tps']:.2f} tok/s; on-CPU share: {result['profile'].get('share', {})}")
    return result


# ---- py-spy raw (collapsed) output -------------------------------------------------------------------

# On-CPU sampling (py-spy's default: idle threads are skipped; a thread waiting for the GIL sleeps in a futex,
# so it counts as idle). py-spy's --gil mode was tried and dropped: on this box it attributed only ~15 % of
# wall time to any GIL holder while the tiny model's engine thread was plainly busy.
PROFILE_RATE = 150
PROFILE_SECONDS = 4

CATEGORIES = [  # first match wins, checked against the whole stack of a UI-thread sample
    ("waiting in select (idle loop)", ("EpollSelector.select",)),
    ("kvtui pane show()/_paint", ("_paint (kvtui/app.py", "show (kvtui/widgets", "_show (kvtui/app.py")),
    (
        "Textual compositor / render",
        ("_compositor.py", "render_lines", "render_line", "_styles_cache.py", "strip.py", "_render", "segment.py"),
    ),
    ("Textual layout / CSS", ("_arrange.py", "_layout", "stylesheet.py", "styles.py", "_resolve.py", "box_model")),
    ("message dispatch", ("message_pump.py", "_dispatch_message", "on_snapshot_ready")),
]


_GENERIC = {
    "Widget",
    "StylesCache",
    "Compositor",
    "Screen",
    "Console",
    "Segment",
    "Text",
    "Strip",
    "MessagePump",
    "App",
    "DOMNode",
    "Content",
    "Visual",
    "KvtuiApp",
    "Timer",
    "ScrollView",
    "Vertical",
    "Horizontal",
    "Container",
    "ScrollableContainer",
    "VerticalScroll",
}
_WIDGET_FRAME = re.compile(
    r"^(\w+)\.(render_line|render_lines|_render_line|_render_line_in_row|_render_cell|render_strips|"
    r"render|_render_content|show|show_messages|show_diagnostics|update|set_model_info|record)\b"
)


def _widget_of(frames: list[str]) -> str:
    """The innermost widget-level frame of a UI-thread sample (which pane's work it was), or idle/other."""
    found = None
    for frame in frames:
        m = _WIDGET_FRAME.match(frame)
        if m and m.group(1) not in _GENERIC:
            found = f"{m.group(1)}.{m.group(2)}"
    if found:
        return found
    if any("EpollSelector.select" in f for f in frames):
        return "(idle: select)"
    return "(other: event loop, layout, compositor glue)"


def summarize_profile(path: Path, rate: int, seconds: float) -> dict:
    threads: Counter = Counter()
    ui_cats: Counter = Counter()
    ui_leaf: Counter = Counter()
    engine_leaf: Counter = Counter()
    ui_widgets: Counter = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        try:
            n = int(count)
        except ValueError:
            continue
        frames = stack.split(";")
        head = frames[0]
        if "bench-" in head:  # the benchmark's own sampler threads (idle in Event.wait)
            continue
        if "MainThread" in head:
            who = "UI thread (asyncio loop)"
        elif "engine_worker" in stack or "session.py" in stack:
            who = "engine worker thread"
        else:
            who = "other threads"
        if "py-spy" in head:
            continue
        threads[who] += n
        total += n
        leaf = frames[-1] if frames else "?"
        if who.startswith("UI"):
            for name, needles in CATEGORIES:
                if any(needle in stack for needle in needles):
                    ui_cats[name] += n
                    break
            else:
                ui_cats["other"] += n
            ui_leaf[leaf] += n
            ui_widgets[_widget_of(frames)] += n
        elif who.startswith("engine"):
            engine_leaf[leaf] += n
    return {
        "ui_widgets": {k: round(v / (rate * seconds), 3) for k, v in ui_widgets.most_common(8)},
        "samples": total,
        "rate": rate,
        "share": {k: round(v / (rate * seconds), 3) for k, v in threads.most_common()},
        "ui_categories": {k: round(v / (rate * seconds), 3) for k, v in ui_cats.most_common()},
        "ui_top": [(leaf, round(n / (rate * seconds), 3)) for leaf, n in ui_leaf.most_common(8)],
        "engine_top": [(leaf, round(n / (rate * seconds), 3)) for leaf, n in engine_leaf.most_common(8)],
    }

"""A real vLLM server killed (SIGKILL) while kvtui follows it, and started again on the same ports: two viewers at
once, headless (a process) and the TUI (the attach app, driven by its pilot, its reader in a child process as
`kvtui attach` runs it), each say the outage once, the
restart and the return; they follow the new server's blocks, hold none of the old one's, apply or count every
batch, write a trace whose every line parses, and end cleanly. The server is the session's spare (conftest.py:
the fleet's second replica), its prefix cache cleared first; it serves on, restarted, for whatever test comes
after."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request

import orjson
import pytest
from rich.console import Console
from textual.widgets import Static
from vllm_servers import ROOT, wait_attached

from kvtui import viewers
from kvtui.app import KvtuiApp
from kvtui.engine.server.attach import AttachOptions, connect
from kvtui.engine.server.prefix_cache import PrefixCache
from kvtui.engine.server.reader_process import ReaderProcess
from kvtui.engine.server.server_trace import load_server_trace

pytestmark = pytest.mark.xdist_group("vllm")  # one vLLM server at a time on the suite's vLLM worker
FIRST = (
    "You are the assistant of a bakery in the old town. Bread is baked at five every morning; croissants sell out "
    "by nine. Cakes are made to order with three days' notice. The bakery is closed on Mondays. Answer briefly."
)
SECOND = (
    "Session two. You run the front desk of a small mountain hotel. Breakfast is served from seven to ten; the "
    "sauna opens at four in the afternoon. Pets are welcome in the ground floor rooms. Answer briefly and kindly."
)


def texts_of(cache: PrefixCache) -> list[str]:
    """The text of every chain root held (what a prompt's first block says)."""
    return [cache.texts.text(block.tokens) for block in cache.blocks.values() if block.depth == 0]


async def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        await asyncio.sleep(0.2)


async def steady(read, seconds: float, timeout: float, what: str):
    """`read()` once it has not changed for `seconds` (events still arriving, or a clear not yet caught up with,
    would make a count read at once a moment's)."""
    deadline = time.monotonic() + timeout
    last, since = read(), time.monotonic()
    while time.monotonic() - since < seconds:
        assert time.monotonic() < deadline, f"{what} kept changing for {timeout} s (last {last})"
        await asyncio.sleep(0.2)
        now = read()
        if now != last:
            last, since = now, time.monotonic()
    return last


def status_text(app: KvtuiApp) -> str:
    return str(app.query_one("#status #status-text").content)


def table_text(app: KvtuiApp) -> str:
    console = Console(width=200, record=True, color_system=None, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(app.query_one("#stats-table", Static).content)
    return console.export_text()


async def test_a_killed_server_restarted_on_the_same_ports_is_followed(vllm_spare, tmp_path):
    server = vllm_spare
    url = server.url
    # what the tests before left cached is cleared (caught up on attach, it is held nowhere after)
    await asyncio.to_thread(server.clear_prefix_cache)
    headless = None
    try:
        # the headless viewer, a process of its own
        headless_trace = tmp_path / "headless.jsonl"
        command = [sys.executable, "-m", "kvtui.cli", "attach", url, "--headless", "--trace", str(headless_trace)]
        headless = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        await asyncio.to_thread(wait_attached, headless)
        # the TUI, here, as `kvtui attach` runs it: its reader in a child process, the pilot drives the screen
        tui_trace = tmp_path / "tui.jsonl"
        options = AttachOptions(urls=[url], trace=tui_trace)
        session = ReaderProcess(options, connect(options))
        session.start()

        def counts():  # the one origin's numbers, as the child last answered (None: no answer in time)
            view = session.stats()
            return view.origins[0][1] if view is not None and view.origins else None

        app = viewers.server(session=session)
        try:
            async with app.run_test(size=(160, 48)) as pilot:
                await asyncio.sleep(3)  # both subscriptions reach the publisher
                await asyncio.to_thread(server.chat, FIRST, "When is the bread ready?")
                await wait_until(lambda: (c := counts()) is not None and c.held >= 2, 60, "the first server's blocks")
                held_before = await steady(lambda: (c := counts()) and c.held, 2.0, 60, "the held blocks")

                os.killpg(server.process.pid, signal.SIGKILL)  # the API server and its engine: a crash
                server.process.wait()
                await wait_until(lambda: session.unreachable(), 30, "the outage to be seen")
                await pilot.pause(0.6)
                assert "UNREACHABLE since " in status_text(app)

                await asyncio.to_thread(server.relaunch)  # the same ports
                await wait_until(lambda: not session.unreachable(), 30, "the server to answer again")
                await asyncio.to_thread(server.chat, SECOND, "When is breakfast?")
                await wait_until(  # the old blocks went with the restart: what is held now is the new server's
                    lambda: (c := counts()) is not None and c.restarts == 1 and c.held >= 2, 60, "the new blocks"
                )
                await asyncio.sleep(6)  # the last batches of the request, and a metrics poll or two
                await pilot.pause(0.6)
                status = status_text(app)
                assert "UNREACHABLE" not in status and "lost 0" in status, status
                table = table_text(app)
                assert "restarts" in table and "gone" in table
                live = counts()
                await pilot.press("q")
        finally:
            session.stop()
        assert not session.running and session.error is None  # the TUI's reader and poller ended cleanly
        lines = [p.message for p in session.problems]

        headless.send_signal(signal.SIGINT)
        out, err = headless.communicate(timeout=60)
        assert headless.returncode == 0, err
        for said in (err.strip().splitlines(), lines):  # each said once, and nothing else (no flood)
            assert len(said) == 3, said
            assert sum("unreachable since" in line for line in said) == 1, said
            assert sum("publisher restarted" in line for line in said) == 1, said
            assert sum("answers again" in line for line in said) == 1, said

        for trace in (tui_trace, headless_trace):  # whole: every line parses, and replays
            records = [orjson.loads(line) for line in trace.read_bytes().splitlines()]
            assert records[0]["type"] == "server-header"
            assert sum(r.get("restart", False) for r in records) == 1
            run = load_server_trace(trace)
            (stats,) = run.cache.origins.values()
            # every batch applied or counted, the old blocks gone (not held), the new ones followed
            assert stats.lost == 0 and stats.restarts == 1 and stats.gone >= 2
            assert stats.held == run.cache.held > 0
            texts = texts_of(run.cache)
            assert texts and all(text.startswith("<|im_start|>system\nSession two") for text in texts), texts
            assert run.batches == stats.batches == sum(r["type"] == "batch" for r in records)
        assert stats.gone == held_before  # the headless viewer saw what the TUI saw
        assert live is not None and (live.held, live.gone, live.restarts, live.lost) == (stats.held, stats.gone, 1, 0)
        assert f"restarts 1 (blocks gone with them {stats.gone})" in out
        # and the restarted server answers as ever
        assert urllib.request.urlopen(f"{url}/health", timeout=10).status == 200
    finally:
        if headless is not None and headless.poll() is None:
            headless.kill()
            headless.wait()

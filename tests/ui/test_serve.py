"""`kvtui serve`: the TUI served by textual-serve, loaded in headless Chromium, really draws.

Chromium runs the page's xterm.js, which draws on a canvas; the test reads the text from xterm's own
buffer (see browser_helpers.CAPTURE_TERMINAL_JS) over the DevTools protocol, and takes a screenshot.
Everything listens on and talks to 127.0.0.1 only; the server and Chromium are killed (with their
children) in `finally`.
"""

from __future__ import annotations

import asyncio
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request

import aiohttp
import pytest

from browser_helpers import (
    CAPTURE_TERMINAL_JS,
    READ_SCREEN_JS,
    Chromium,
    DevTools,
    find_chromium,
    free_port,
    png_size,
    stop_process_group,
)
from kvtui.commands.serve_cmd import app_command

SERVER_START_S = 20.0  # until the server answers HTTP
APP_DRAWN_S = 60.0  # until the browser shows the app (a kvtui process starts and loads the tiny model)
WINDOW = (1280, 800)


def test_app_command_quotes_and_names_run():
    argv = ["my model", "--system", "be brief; $(really)", "--cache", "static"]
    command = app_command(argv)
    assert shlex.split(command) == [sys.executable, "-m", "kvtui.cli", "run", *argv]


def test_serve_refuses_bad_pass_through_options():
    from click.testing import CliRunner

    from kvtui.commands.serve_cmd import serve

    result = CliRunner().invoke(serve, ["some-model", "--cache", "bogus"])
    assert result.exit_code == 2 and "--cache" in result.output
    result = CliRunner().invoke(serve, ["some-model", "--headless"])
    assert result.exit_code == 2 and "--headless" in result.output


def _wait_http(url: str, server: subprocess.Popen, log_path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"`kvtui serve` exited with {server.returncode}:\n{_tail(log_path)}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError) as exc:
            last = exc
        time.sleep(0.2)
    pytest.fail(f"`kvtui serve` did not answer {url} in {timeout:.0f} s ({last}):\n{_tail(log_path)}")


def _tail(path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


async def _wait_screen(devtools: DevTools, done, timeout: float) -> dict:
    """Poll xterm's screen until done(screen) (or the session closes, or timeout); returns the last screen."""
    deadline = time.monotonic() + timeout
    screen: dict = {}
    while time.monotonic() < deadline:
        try:
            screen = await devtools.evaluate(READ_SCREEN_JS) or {}
        except RuntimeError:  # the page is still navigating
            screen = {}
        if screen.get("closed") or done(screen):
            break
        await asyncio.sleep(0.25)
    return screen


async def _press(devtools: DevTools, key: str, code: int) -> None:
    """A real key press in the page: xterm turns it into an escape sequence for the served app."""
    await devtools.evaluate("window.__xtermTerminals[0].focus()")
    for kind in ("rawKeyDown", "keyUp"):
        await devtools.call(
            "Input.dispatchKeyEvent",
            type=kind,
            key=key,
            code=key,
            windowsVirtualKeyCode=code,
            nativeVirtualKeyCode=code,
        )


def _main_screen_drawn(screen: dict) -> bool:
    text = screen.get("text", "")
    # the app's title on the chat pane, the panes, and the loaded model in the status bar
    return "kvtui · run mode" in text and "cache" in text and "Qwen2ForCausalLM" in text


def _help_drawn(screen: dict) -> bool:
    return "kvtui keys" in screen.get("text", "")  # the help screen's title


async def _browse(chromium: Chromium, url: str) -> dict:
    """Open url, wait for the main screen, screenshot it, press F1, wait for the help and its title "kvtui"."""
    async with aiohttp.ClientSession() as http:
        ws_url = await chromium.page_websocket_url(http)
        websocket = await http.ws_connect(ws_url, max_msg_size=0)  # screenshots are megabytes
        devtools = DevTools(websocket)
        try:
            await devtools.call("Page.enable")
            await devtools.call("Page.addScriptToEvaluateOnNewDocument", source=CAPTURE_TERMINAL_JS)
            await devtools.call("Page.navigate", url=url)
            main = await _wait_screen(devtools, _main_screen_drawn, APP_DRAWN_S)
            result = {"main": main}
            if not _main_screen_drawn(main):
                return result
            await asyncio.sleep(0.5)  # the canvas draws on the next animation frames after the buffer
            result["main_png"] = await devtools.screenshot()
            result["main_stats"] = await devtools.png_stats(result["main_png"])
            await _press(devtools, "F1", 112)
            result["help"] = await _wait_screen(devtools, _help_drawn, 15)
            await asyncio.sleep(0.5)
            result["help_png"] = await devtools.screenshot()
            return result
        finally:
            await devtools.close()


async def test_serve_in_headless_chromium(tiny_dir, tmp_path):
    binary = find_chromium()
    if binary is None:
        pytest.fail(
            "Chromium is needed for the `kvtui serve` browser test and was not found "
            "(Debian/Ubuntu: apt-get install -y chromium)"
        )
    model_dir = tiny_dir("qwen2")
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    server_log = tmp_path / "serve.log"
    chromium = Chromium(binary, tmp_path / "chromium-profile", tmp_path / "chromium.log", window=WINDOW)
    server = None
    try:
        with open(server_log, "wb") as log:
            server = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "from kvtui.commands.serve_cmd import serve; serve()",
                    str(model_dir),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--max-new-tokens",
                    "8",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        _wait_http(url, server, server_log, SERVER_START_S)
        assert f"serving on http://127.0.0.1:{port}" in server_log.read_text(errors="replace")

        await asyncio.to_thread(chromium.start)
        result = await asyncio.wait_for(_browse(chromium, url), APP_DRAWN_S + 40)

        def context(screen: dict) -> str:
            return (
                f"screen ({screen.get('source')}, {screen.get('cols')}x{screen.get('rows')}):\n"
                f"{screen.get('text', '')}\n--- server log:\n{_tail(server_log)}\n"
                f"--- chromium log:\n{chromium.log_tail()}"
            )

        main = result["main"]
        assert not main.get("closed"), f"the served session ended:\n{context(main)}"
        assert main.get("source") == "xterm-buffer", f"could not reach xterm's buffer:\n{context(main)}"
        assert _main_screen_drawn(main), f"the app's main screen never showed:\n{context(main)}"
        assert main["cols"] >= 80 and main["rows"] >= 24, context(main)
        # The app has no header: its title "kvtui" is drawn by the help screen (F1, sent through the page).
        assert _help_drawn(result["help"]), f"F1 did not bring up the help with the title:\n{context(result['help'])}"

        for name in ("main", "help"):
            (tmp_path / f"serve-{name}.png").write_bytes(result[f"{name}_png"])
        png, stats = result["main_png"], result["main_stats"]
        assert png_size(png) == (stats["width"], stats["height"])
        assert stats["width"] >= WINDOW[0] // 2 and stats["height"] >= WINDOW[1] // 2, stats
        # A blank page or a bare background is one or two colours; the drawn app has text and panes.
        assert stats["colours"] >= 16 and stats["dominantShare"] < 0.98, stats
        assert len(png) > 20_000, len(png)
    finally:
        chromium.stop()
        stop_process_group(server)

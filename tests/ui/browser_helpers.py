"""Headless Chromium driven over the DevTools protocol (a tiny aiohttp client), for the serve test.

Loopback only: Chromium is told to resolve every other host to nothing, and DevTools listens on
127.0.0.1 on a port Chromium picks itself (read back from DevToolsActivePort).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path

import aiohttp

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-dev-shm-usage",
    "--mute-audio",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
    # Nothing but loopback: the page asks fonts.googleapis.com for Roboto Mono; let that fail fast.
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1, EXCLUDE localhost",
]

# Runs before the page's own scripts. textual-serve keeps its xterm.js Terminal in a closure
# (`this.terminal = new Terminal(...)` inside its session class); a setter on Object.prototype
# catches that one assignment, keeps the Terminal in window.__xtermTerminals and removes itself.
CAPTURE_TERMINAL_JS = r"""
(() => {
  const found = (window.__xtermTerminals = []);
  Object.defineProperty(Object.prototype, "terminal", {
    configurable: true,
    get() { return undefined; },
    set(value) {
      Object.defineProperty(this, "terminal", { value, writable: true, enumerable: true, configurable: true });
      if (value && typeof value.write === "function" && value.buffer && value.buffer.active) {
        found.push(value);
        delete Object.prototype.terminal;
      }
    },
  });
})();
"""

# The text xterm.js holds on screen (its buffer, not the canvas), one line per row.
READ_SCREEN_JS = r"""
(() => {
  const state = {
    firstByte: document.body ? document.body.classList.contains("-first-byte") : false,
    closed: document.body ? document.body.classList.contains("-closed") : false,
    source: null, cols: 0, rows: 0, text: "",
  };
  const term = (window.__xtermTerminals || [])[0];
  if (term) {
    const buffer = term.buffer.active;
    const lines = [];
    for (let y = 0; y < term.rows; y++) {
      const line = buffer.getLine(buffer.viewportY + y);
      lines.push(line ? line.translateToString(true) : "");
    }
    Object.assign(state, { source: "xterm-buffer", cols: term.cols, rows: term.rows, text: lines.join("\n") });
  } else {
    // Fallback: xterm's DOM renderer (no canvas) or its accessibility tree hold the text in the DOM.
    const rows = document.querySelector(".xterm-rows") || document.querySelector(".xterm-accessibility");
    if (rows) {
      Object.assign(state, { source: "dom", text: Array.from(rows.children, (row) => row.textContent).join("\n") });
    }
  }
  return state;
})()
"""

# Decode a PNG (data URL) in the page and summarise its pixels.
PNG_STATS_JS = r"""
(async (url) => {
  const image = new Image();
  image.src = url;
  await image.decode();
  const canvas = document.createElement("canvas");
  canvas.width = image.width;
  canvas.height = image.height;
  const ctx = canvas.getContext("2d");
  ctx.drawImage(image, 0, 0);
  const data = ctx.getImageData(0, 0, image.width, image.height).data;
  const counts = new Map();
  for (let i = 0; i < data.length; i += 4) {
    const key = (data[i] << 16) | (data[i + 1] << 8) | data[i + 2];
    counts.set(key, (counts.get(key) || 0) + 1);
  }
  const pixels = data.length / 4;
  const dominant = Math.max(...counts.values());
  return { width: image.width, height: image.height, colours: counts.size, dominantShare: dominant / pixels };
})
"""


def find_chromium() -> str | None:
    for candidate in CHROMIUM_CANDIDATES:
        path = shutil.which(candidate)
        if path:
            return path
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_process_group(process: subprocess.Popen | None, grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL, the group of a process started with start_new_session=True (it leads the group,
    so the group id is its pid): the leader and everything it spawned (app sessions, renderers)."""
    if process is None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # whatever is left in the group
    except ProcessLookupError:
        pass
    process.wait(timeout=grace)


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR; raises ValueError for anything that is not a PNG."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise ValueError("not a PNG")
    return struct.unpack(">II", data[16:24])


class Chromium:
    """A headless Chromium process on a fresh profile, with its DevTools port."""

    def __init__(self, binary: str, profile: Path, log_path: Path, window: tuple[int, int] = (1280, 800)):
        self.binary = binary
        self.profile = profile
        self.log_path = log_path
        self.window = window
        self.process: subprocess.Popen | None = None
        self.devtools_port: int | None = None

    def start(self, timeout: float = 20.0) -> None:
        self.profile.mkdir(parents=True, exist_ok=True)
        argv = [
            self.binary,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={self.profile}",
            f"--window-size={self.window[0]},{self.window[1]}",
            "about:blank",
        ]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.process.returncode}:\n{self.log_tail()}")
            if port_file.exists():
                first = port_file.read_text().split("\n", 1)[0].strip()
                if first.isdigit():
                    self.devtools_port = int(first)
                    return
            time.sleep(0.1)
        raise RuntimeError(f"chromium did not open its DevTools port in {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        stop_process_group(self.process)

    async def page_websocket_url(self, session: aiohttp.ClientSession, timeout: float = 10.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            async with session.get(f"http://127.0.0.1:{self.devtools_port}/json/list") as response:
                targets = await response.json(content_type=None)
            pages = [t for t in targets if t.get("type") == "page" and t.get("webSocketDebuggerUrl")]
            if pages:
                return pages[0]["webSocketDebuggerUrl"]
            if time.monotonic() > deadline:
                raise RuntimeError(f"no page target in {targets!r}")
            await asyncio.sleep(0.1)


class DevTools:
    """Just enough of the DevTools protocol: send a command, await its result (events are dropped)."""

    def __init__(self, websocket: aiohttp.ClientWebSocketResponse):
        self.websocket = websocket
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for message in self.websocket:
                if message.type != aiohttp.WSMsgType.TEXT:
                    continue
                payload = json.loads(message.data)
                future = self._pending.pop(payload.get("id"), None)
                if future is not None and not future.done():
                    future.set_result(payload)
        finally:
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(ConnectionError("DevTools connection closed"))

    async def call(self, method: str, timeout: float = 15.0, **params):
        command_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[command_id] = future
        await self.websocket.send_str(json.dumps({"id": command_id, "method": method, "params": params}))
        payload = await asyncio.wait_for(future, timeout)
        if "error" in payload:
            raise RuntimeError(f"{method}: {payload['error']}")
        return payload.get("result", {})

    async def evaluate(self, expression: str, timeout: float = 15.0):
        result = await self.call(
            "Runtime.evaluate", timeout=timeout, expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"JS error: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def close(self) -> None:
        self._reader.cancel()
        await self.websocket.close()

    async def screenshot(self) -> bytes:
        result = await self.call("Page.captureScreenshot", timeout=30.0, format="png")
        return base64.b64decode(result["data"])

    async def png_stats(self, png: bytes) -> dict:
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        return await self.evaluate(f"({PNG_STATS_JS})({json.dumps(url)})", timeout=30.0)

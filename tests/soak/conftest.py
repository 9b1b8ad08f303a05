"""Fixtures for the soak, crash and property tests: one torch thread (tiny_loaded is in tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture
def one_torch_thread():
    """One intra-op thread for the duration of a test, then the previous setting.

    On a 2-core machine shared with Textual's event loop (or with other processes), torch's default
    of one OpenMP thread per core makes each tiny forward spin-wait on a busy core: measured here,
    500 decode steps took 9.7 s with 2 threads and 1.1 s with 1. Threads started later (the app's
    engine worker) inherit the setting."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)

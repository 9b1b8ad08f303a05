"""How the session's forwards run, never what they compute: torch.compile for one-token decode steps over a
static cache (and the graphs it built), and the CPU threads a forward runs on.

Neither touches the cache: session.py calls the model; these only wrap that call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


class CompiledDecode:
    """model.forward under torch.compile, the way transformers documents it for a static cache (fixed shapes: one
    token, a preallocated cache), built on first use; and the graphs compiled so far (more than one: recompiles)."""

    def __init__(self, model, device: torch.device):
        self._model, self._device = model, device
        self._forward: Callable | None = None
        self.compiles = 0  # graphs compiled so far (the first one included)
        self.compile_ms_total = 0.0

    @property
    def recompiles(self) -> int:
        return max(0, self.compiles - 1)

    def forward(self) -> Callable:
        """ "reduce-overhead" adds CUDA graphs on a GPU; on CPU the default mode (inductor, C++ codegen) is used."""
        if self._forward is None:
            mode = "reduce-overhead" if self._device.type == "cuda" else None
            self._forward = torch.compile(self._model.forward, mode=mode, fullgraph=False, dynamic=False)
        return self._forward

    def compile_ms(self, graphs_before: int, forward_ms: float) -> float | None:
        """The step's compile time: all of its forward when it built graphs (not a slow step), else None."""
        new_graphs = graph_count() - graphs_before
        if not new_graphs:
            return None
        self.compiles += new_graphs
        self.compile_ms_total += forward_ms
        return forward_ms


def graph_count() -> int:
    """Graphs torch.compile has built in this process (dynamo's own counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@contextmanager
def forward_threads(tokens: int, decode_threads: int | None) -> Iterator[None]:
    """A one-token forward on `decode_threads` (a viewer sharing the cores keeps one of them), then torch's
    threads back as they were; any other forward on them as they are. Decode is bound by memory and Python,
    and an OpenMP team that loses a core to another process waits for it at every op; a prefill is bound
    by compute and uses every thread. (Switching costs well under a microsecond.)"""
    before = torch.get_num_threads()
    wanted = decode_threads if tokens == 1 and decode_threads else before
    if wanted == before:
        yield
        return
    torch.set_num_threads(wanted)
    try:
        yield
    finally:
        torch.set_num_threads(before)

"""What each part of a watched step costs where it runs: one watched loop whose steps alternate between the
part on and the part switched off (A B B A ...), on the Python-bound 3-layer tiny llama, with a trace.

Why a second measure next to b_step_cost.py's part clocks: a part timed alone, or by wrapping its function,
runs with warm caches or pays the wrapper; right after a forward it runs cold (a function that takes 25 µs
in a tight loop takes ~100 µs there). Here nothing is wrapped: a part's cost is the median step with it
minus the median step without it, both from the same loop, the same process, the same minutes.

A part switched off leaves the rest of the step as it is, except what only it fed: without layer infos the
step record has no layers to serialise, so that row includes their share of the record. Every row is
measured in its own loop; the rows do not add up to the whole (the parts share caches and frames).

    python benchmarks/b_knockout.py [STEPS]    (default 3000 steps a part: ~5 s each)
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from b_step_cost import UserLoop
from common import log
from kvtui.engine.chat.loader import load_model
from kvtui.engine.models.tiny import build_tiny
from kvtui.engine.reading import introspect
from kvtui.engine.watch import probe, watch_step


def _no_top(scores, k):
    rows = scores.shape[0]  # nothing computed: the transfer carries no top-k and the step shows none
    empty = torch.empty(rows, 0, device=scores.device)
    return empty, empty, torch.empty(rows, 0, dtype=torch.long, device=scores.device)


# part -> (object, attribute, what it becomes when the part is off); None: the calibration row (A = B)
PARTS = {
    "nothing (calibration: both sides the same)": None,
    "top-k (topk, log_softmax, gather, its share of the read, TopTokens)": (watch_step, "top_tensors", _no_top),
    "fingerprint (end-slot copies; the next forward's check)": (introspect, "fingerprint", lambda cache: None),
    "layer infos (and their share of the record)": (introspect, "layer_infos", lambda cache, window=None: ()),
    "caller line (the stack walk)": (probe, "caller_and_generate", lambda skip, start=None: ("program.py:1", [])),
    "trace record (building, serialising, writing)": ("recorder", "record", lambda snapshot: None),
}


def knockout(model, tokenizer, part: str, steps: int, trace_dir: Path) -> dict:
    """Median step wall time with the part on (A) and off (B), A B B A over `steps` steps."""
    spec = PARTS[part]
    times: dict[str, list[float]] = {"on": [], "off": []}
    with probe.watch(model, tokenizer, trace=trace_dir / "knockout.jsonl") as watcher:
        loop = UserLoop(model, tokenizer)  # its prefill is the first forward: the watcher's recorder exists after it
        owner = None
        if spec is not None:
            owner = watcher.recorder if spec[0] == "recorder" else spec[0]
            original = getattr(owner, spec[1])
        try:
            for i in range(steps):
                on = (i // 2) % 2 == i % 2  # A B B A: neither side always goes first
                if owner is not None:
                    setattr(owner, spec[1], original if on else spec[2])
                started = time.perf_counter()
                loop.step()
                times["on" if on else "off"].append(time.perf_counter() - started)
                if loop.cache.get_seq_length() > 400:  # a long loop would measure a longer cache
                    loop = UserLoop(model, tokenizer)
        finally:
            if owner is not None:
                if owner is watcher.recorder:
                    del owner.record  # the instance attribute goes: the class's method is back
                else:
                    setattr(owner, spec[1], original)
    on, off = statistics.median(times["on"]) * 1e6, statistics.median(times["off"]) * 1e6
    return {"on_us": on, "off_us": off, "cost_us": on - off, "steps": steps}


def bench(model, tokenizer, steps: int = 3000) -> dict:
    """part -> {on_us, off_us, cost_us, steps}, every part of PARTS in its own loop."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # Python-bound, as b_step_cost measures it
    try:
        with tempfile.TemporaryDirectory(prefix="kvtui-knockout-") as tmp:
            out = {}
            for part in PARTS:
                out[part] = knockout(model, tokenizer, part, steps, Path(tmp))
                log(f"  {part}: {out[part]['cost_us']:+.0f} µs a step (step {out[part]['on_us']:.0f} µs with it)")
            return out
    finally:
        torch.set_num_threads(threads)


def table(result: dict) -> list[str]:
    lines = [
        "| part of a watched step (3-layer tiny llama, with a trace) | µs a step, in place | step with it (µs) |",
        "|---|---|---|",
    ]
    for part, r in result.items():
        lines.append(f"| {part} | {r['cost_us']:+.0f} | {r['on_us']:.0f} |")
    return lines


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="kvtui-knockout-model-") as _tmp:
        _tiny = load_model(str(build_tiny("llama", Path(_tmp) / "tiny-llama", layers=3)), dtype="float32", device="cpu")
        found = bench(_tiny.model, _tiny.tokenizer, int(sys.argv[1]) if len(sys.argv) > 1 else 3000)
    print("\n".join(table(found)))

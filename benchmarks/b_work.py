"""6c. The work kvtui does per decode step, counted (no timing noise): the lines of kvtui's own Python executed
(every thread, `sys.settrace` restricted to kvtui's files), the tensor operations kvtui issues (a
TorchDispatchMode counting the non-view ops whose innermost frame outside torch is kvtui's), and the tensor
reads that synchronise with the device (`.tolist()`, `.item()`, `int()`, `torch.equal`, ...) made from kvtui's
frames. A watched hand-written greedy loop (DynamicCache, inference mode, a trace written) on a 3-layer and a
32-layer tiny Llama (hidden 64: deep and narrow, so the model's own cost does not hide anything).

On a GPU the host work is what a watched step costs: ~80 lines per layer per step were ~1.4 ms on a 30-layer
model on an H100 (issue 43). What grows with the layer count is what this counts.

Usage: python benchmarks/b_work.py [--layers 3,32] [--steps 20] [--json OUT] [--verbose] [--top N] [--attention]
(`--attention`: the watched rows with attention capture on, `watch(attention=True)`)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402,F401  (environment before torch loads)

# isort: split
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import kvtui  # noqa: E402
from b_step_cost import UserLoop  # noqa: E402
from common import log  # noqa: E402

KVTUI_DIR = os.path.dirname(os.path.abspath(kvtui.__file__)) + os.sep
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
HERE = os.path.abspath(__file__)


def _from_kvtui(depth: int = 2) -> bool:
    """Whether the innermost frame outside torch (and this file) is kvtui's."""
    frame = sys._getframe(depth)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(TORCH_DIR) and name != HERE and not name.startswith("<"):
            return name.startswith(KVTUI_DIR)
        frame = frame.f_back
    return False


class LineCounter:
    """Line events in kvtui's files and in the code kvtui generates (`exec`), on every thread (threads started
    while counting too); and the bytecode instructions those frames execute, which no layout of the source
    changes (a call or a dict literal written over ten lines is ten line events, and the same instructions)."""

    def __init__(self):
        self.lines = 0
        self.instructions = 0
        self.by_file: Counter = Counter()
        self.instructions_by_file: Counter = Counter()
        self._lock = threading.Lock()

    def _local(self, frame, event, arg):
        if event == "opcode":
            self.instructions += 1
            self.instructions_by_file[(frame.f_code.co_filename, frame.f_code.co_name)] += 1
        elif event == "line":
            self.lines += 1  # one thread at a time runs Python: the GIL orders these
            self.by_file[(frame.f_code.co_filename, frame.f_code.co_name)] += 1
        return self._local

    def _global(self, frame, event, arg):
        name = frame.f_code.co_filename
        caller = frame.f_back
        if name.startswith(KVTUI_DIR) or (
            # code kvtui generated (its record values' __init__, its codec's field readers)
            name == "<string>" and caller is not None and caller.f_code.co_filename.startswith(KVTUI_DIR)
        ):
            frame.f_trace_opcodes = True
            return self._local
        return None

    def start(self) -> None:
        threading.settrace(self._global)
        sys.settrace(self._global)

    def stop(self) -> None:
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]


class OpCounter(TorchDispatchMode):
    """Non-view aten ops whose innermost frame outside torch is kvtui's (views cost host time, no kernel)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and _from_kvtui(2):
            self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


_READS = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


class ReadCounter:
    """Calls that copy a tensor's data to the host (and wait for its device), made from kvtui's frames."""

    def __init__(self):
        self.reads: Counter = Counter()
        self._undo: list = []

    def _wrap(self, owner, name: str) -> None:
        original = getattr(owner, name)
        reads = self.reads

        def counted(*args, **kwargs):
            if _from_kvtui(2):
                reads[name] += 1
            return original(*args, **kwargs)

        self._undo.append((owner, name, original))
        setattr(owner, name, counted)

    def start(self) -> None:
        for name in _READS:
            self._wrap(torch.Tensor, name)
        self._wrap(torch, "equal")

    def stop(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()


def _model(layers: int, tmp: Path):
    from transformers.utils import logging as hf_logging

    from kvtui.engine.chat.loader import load_model
    from kvtui.engine.models.tiny import build_tiny

    hf_logging.disable_progress_bar()
    loaded = load_model(str(build_tiny("llama", tmp / f"tiny-llama-{layers}", layers=layers)), dtype="float32")
    return loaded.model, loaded.tokenizer


def count(layers: int, steps: int, tmp: Path, context: int = 0, top: int = 12, attention: bool = False) -> dict:
    """Per decode step of a watched greedy loop (a trace written): kvtui's lines, ops and device reads.
    `context`: tokens fed after the prompt (one more prefill) before the counted steps."""
    from kvtui.engine.watch import probe

    model, tokenizer = _model(layers, tmp)
    with probe.watch(model, tokenizer, trace=tmp / f"work-{layers}-{context}.jsonl", attention=attention) as watcher:
        loop = UserLoop(model, tokenizer)  # the prefill
        if context:
            ids = torch.randint(3, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
            with torch.inference_mode():
                out = model(input_ids=ids, past_key_values=loop.cache, use_cache=True)
            loop.token = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(4):  # warm: first-step caches filled (pieces, specials, call sites)
            loop.step()
        row = _counted(loop.step, steps, top)
        assert watcher.steps == steps + 5 + (1 if context else 0), watcher.steps
        length = loop.cache.get_seq_length()
        errors = list(watcher.errors)
    return {"layers": layers, "steps": steps, "cached_tokens": length, **row, "errors": errors}


def _counted(step, steps: int, top: int) -> dict:
    """Run `step()` `steps` times under the three counters: per step, kvtui's lines, ops and device reads."""
    lines, reads = LineCounter(), ReadCounter()
    reads.start()
    try:
        with OpCounter() as ops:
            lines.start()
            try:
                for _ in range(steps):
                    step()
            finally:
                lines.stop()
    finally:
        reads.stop()
    return {
        "lines_per_step": lines.lines / steps,
        "instructions_per_step": lines.instructions / steps,
        "ops_per_step": sum(ops.ops.values()) / steps,
        "reads_per_step": sum(reads.reads.values()) / steps,
        "ops": {name: n / steps for name, n in sorted(ops.ops.items())},
        "reads": {name: n / steps for name, n in sorted(reads.reads.items())},
        "top_functions": [
            {"where": f"{os.path.relpath(f, KVTUI_DIR)}:{fn}", "lines_per_step": n / steps}
            for (f, fn), n in lines.by_file.most_common(top)
        ],
        "top_functions_by_instructions": [
            {"where": f"{os.path.relpath(f, KVTUI_DIR)}:{fn}", "instructions_per_step": n / steps}
            for (f, fn), n in lines.instructions_by_file.most_common(top)
        ],
    }


def count_session(layers: int, steps: int, tmp: Path, top: int = 12) -> dict:
    """Per decode step of kvtui's own chat (`ChatSession.step`, greedy, its trace written by the one Recorder as
    `--headless` writes it, no verify): the same counters as a watched step, on the same model."""
    from kvtui.engine.chat.session import ChatSession
    from kvtui.engine.chat.session_types import SessionConfig
    from kvtui.engine.records.recorder import Recorder

    model, tokenizer = _model(layers, tmp)
    session = ChatSession(model, tokenizer, SessionConfig(max_new_tokens=steps + 10))  # no end token: never stops
    recorder = Recorder(session, tmp / f"session-{layers}.jsonl", model_source="tiny", model_path=str(tmp))
    try:
        session.send("What is k?")  # the prefill
        for _ in range(4):  # warm, as the watched loop
            session.step()
        row = _counted(session.step, steps, top)
    finally:
        recorder.close()
    return {"layers": layers, "steps": steps, "cached_tokens": session.cache_length, **row}


def bench(layer_counts=(3, 32), steps: int = 20, context: int = 3000, top: int = 12, attention: bool = False) -> dict:
    """The rows by layer count; then the first layer count again after `context` more cached tokens (the work
    must not grow with the context either)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory(prefix="kvtui-work-") as tmp:
            rows = [count(n, steps, Path(tmp), top=top, attention=attention) for n in layer_counts]
            long = count(layer_counts[0], steps, Path(tmp), context, top, attention) if context else None
            sessions = [count_session(n, steps, Path(tmp), top) for n in layer_counts]
    finally:
        torch.set_num_threads(threads)
    out: dict = {"rows": rows, "session_rows": sessions, "attention": attention}
    if len(rows) >= 2:
        out["lines_ratio"] = rows[-1]["lines_per_step"] / rows[0]["lines_per_step"]
    if long is not None:
        out["long_context"] = long
    return out


def describe(result: dict) -> str:
    rows = result["rows"]
    text = "; ".join(
        f"{r['layers']} layers: {r['lines_per_step']:.0f} lines, {r['ops_per_step']:.1f} ops, "
        f"{r['reads_per_step']:.1f} device reads per step"
        for r in rows
    )
    if "lines_ratio" in result:
        text += f" (lines {rows[-1]['layers']}/{rows[0]['layers']} layers: {result['lines_ratio']:.2f}x)"
    sessions = result.get("session_rows") or []
    if sessions:
        text += "; kvtui's own chat (ChatSession.step): " + ", ".join(
            f"{r['layers']} layers {r['lines_per_step']:.0f} lines, {r['ops_per_step']:.1f} ops, "
            f"{r['reads_per_step']:.1f} reads"
            for r in sessions
        )
    long = result.get("long_context")
    if long:
        text += (
            f"; {long['layers']} layers at {long['cached_tokens']} cached tokens: {long['lines_per_step']:.0f} lines, "
            f"{long['ops_per_step']:.1f} ops, {long['reads_per_step']:.1f} reads"
        )
    return text


def table(result: dict) -> list[str]:
    rows = result["rows"] + ([result["long_context"]] if result.get("long_context") else [])
    attention = ", attention on" if result.get("attention") else ""
    lines = [
        f"| per decode step (watched greedy loop, trace written{attention}) | "
        + " | ".join(f"{r['layers']} layers, {r.get('cached_tokens', '?')} cached" for r in rows)
        + " |",
        "|---|" + "---|" * len(rows),
        "| lines of kvtui's Python (every thread) | " + " | ".join(f"{r['lines_per_step']:.0f}" for r in rows) + " |",
        "| bytecode instructions of kvtui's Python | "
        + " | ".join(f"{r['instructions_per_step']:.0f}" for r in rows)
        + " |",
        "| tensor ops kvtui adds (non-view) | " + " | ".join(f"{r['ops_per_step']:.1f}" for r in rows) + " |",
        "| device reads from kvtui (`tolist`, `item`, `int()`, `torch.equal`, ...) | "
        + " | ".join(f"{r['reads_per_step']:.1f}" for r in rows)
        + " |",
    ]
    sessions = result.get("session_rows") or []
    if sessions:
        lines += [
            "",
            "| per decode step, kvtui's own chat (ChatSession.step, trace written) | "
            + " | ".join(f"{r['layers']} layers, {r['cached_tokens']} cached" for r in sessions)
            + " |",
            "|---|" + "---|" * len(sessions),
            "| lines of kvtui's Python (every thread) | "
            + " | ".join(f"{r['lines_per_step']:.0f}" for r in sessions)
            + " |",
            "| bytecode instructions | " + " | ".join(f"{r['instructions_per_step']:.0f}" for r in sessions) + " |",
            "| tensor ops (non-view) | " + " | ".join(f"{r['ops_per_step']:.1f}" for r in sessions) + " |",
            "| device reads | " + " | ".join(f"{r['reads_per_step']:.1f}" for r in sessions) + " |",
        ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="3,32")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--context", type=int, default=3000, help="a row with this many more cached tokens (0: none)")
    parser.add_argument("--json", help="write the raw numbers here")
    parser.add_argument("--verbose", action="store_true", help="the ops, reads and busiest functions per row")
    parser.add_argument("--top", type=int, default=12, help="how many of the busiest functions (with --verbose)")
    parser.add_argument("--attention", action="store_true", help="the watched rows with attention capture on")
    args = parser.parse_args()
    layers = tuple(int(n) for n in args.layers.split(","))
    result = bench(layers, args.steps, args.context, args.top, args.attention)
    log(describe(result))
    print("\n".join(table(result)))
    if args.verbose:
        for row in result["rows"] + ([result["long_context"]] if result.get("long_context") else []):
            print(f"\n{row['layers']} layers: ops {row['ops']}, reads {row['reads']}, errors {row['errors']}")
            for entry in row["top_functions"]:
                print(f"  {entry['lines_per_step']:7.1f}  {entry['where']}")
            print("  by bytecode instructions:")
            for entry in row["top_functions_by_instructions"]:
                print(f"  {entry['instructions_per_step']:7.0f}  {entry['where']}")
        for row in result.get("session_rows") or []:
            print(f"\nkvtui's own chat, {row['layers']} layers: ops {row['ops']}, reads {row['reads']}")
            for entry in row["top_functions"]:
                print(f"  {entry['lines_per_step']:7.1f}  {entry['where']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

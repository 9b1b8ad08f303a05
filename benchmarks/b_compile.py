"""The static + compile lesson, measured: the same greedy chat on SmolLM2-135M-Instruct with a dynamic
cache, a static cache, and a static cache whose one-token decode forward is torch.compile'd (kvtui's
--compile). Decode tokens/s excludes the step that compiled (reported as compile time); greedy tokens
are compared across the three runs. All three run side by side in one process, interleaved per repeat.

Usage: python benchmarks/b_compile.py [--new 32] [--repeats 2] [--out benchmarks/COMPILE.md]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402,F401  (environment before torch loads)

# isort: split
import torch  # noqa: E402
import transformers  # noqa: E402

from kvtui.engine.chat.loader import load_model  # noqa: E402
from kvtui.engine.chat.session import ChatSession, SessionConfig  # noqa: E402

TURNS = ["Let's start by defining a variable k equal to 5. What is k?", "Now multiply k by 3. What is k?"]
CONFIGS = {
    "dynamic": dict(cache="dynamic"),
    "static": dict(cache="static", max_cache_len=512),
    "static+compile": dict(cache="static", max_cache_len=512, compile=True),
}


def run(model, tokenizer, name: str, new: int) -> dict:
    session = ChatSession(model, tokenizer, SessionConfig(max_new_tokens=new, **CONFIGS[name]))
    decode_s, decode_n, compile_s = 0.0, 0, 0.0
    for turn in TURNS:
        session.send(turn)
        while not session.turn_done:
            t0 = time.perf_counter()
            snap = session.step()
            dt = time.perf_counter() - t0
            if snap.compile_ms is not None:
                compile_s += dt
            else:
                decode_s += dt
                decode_n += 1
    return {
        "tok_s": decode_n / decode_s if decode_s else 0.0,
        "tokens": decode_n,
        "compile_s": compile_s,
        "ids": session.buffer.ids(),
        "recompiles": session.recompiles if name.endswith("compile") else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads for all three runs (0: torch's default)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "COMPILE.md"))
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(None, dtype="float32", device="auto")
    model, tokenizer = loaded.model, loaded.tokenizer
    results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for repeat in range(args.repeats):
        for name in CONFIGS:
            r = run(model, tokenizer, name, args.new)
            results[name].append(r)
            print(
                f"repeat {repeat + 1} {name:15s} {r['tok_s']:6.1f} tok/s over {r['tokens']} decode steps"
                + (f", compile {r['compile_s']:.1f} s, recompiles {r['recompiles']}" if r["compile_s"] else ""),
                flush=True,
            )
    same = all(r["ids"] == results["dynamic"][0]["ids"] for rs in results.values() for r in rs)
    lines = [
        "# Dynamic vs static vs static + compile (SmolLM2-135M-Instruct, greedy)",
        "",
        f"{loaded.device}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, Python {platform.python_version()}; "
        f"{len(TURNS)} turns, up to {args.new} new tokens each, {args.repeats} interleaved repeats. "
        "Decode tokens/s: one-token steps through `ChatSession.step` (snapshots included), the compiling "
        "step excluded and reported as compile time.",
        "",
        "| cache | decode tok/s (median) | all repeats | first compile | recompiles |",
        "|---|---|---|---|---|",
    ]
    for name, rs in results.items():
        speeds = [r["tok_s"] for r in rs]
        compile_text = f"{rs[0]['compile_s']:.1f} s" if rs[0]["compile_s"] else "-"
        lines.append(
            f"| {name} | {statistics.median(speeds):.1f} | {', '.join(f'{s:.1f}' for s in speeds)} | "
            f"{compile_text} | {rs[-1]['recompiles'] if rs[-1]['recompiles'] is not None else '-'} |"
        )
    lines += ["", f"Greedy tokens identical across all runs: {'yes' if same else 'NO'}."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

"""11. `kvtui MODEL --headless` as a user runs it, whole process (interpreter start to exit), against a bare
transformers greedy loop in its own process making the same tokens (the same converted SmolLM2 directory,
the same prompt through the same chat template, argmax, DynamicCache). Variants (interleaved in each repeat,
the order rotated; medians over the repeats; ratios per repeat against that repeat's bare loop):
- bare: the loop as a user writes it (torch's threads, libgomp's default wait: ~300,000 spins, then sleep);
- bare_short_spin: the same loop with kvtui's OpenMP wait (GOMP_SPINCOUNT=1000): kvtui / this is kvtui's own cost;
- kvtui: the command as shipped (decodes on every thread, a short spin);
- kvtui_keep_core: --decode-threads one fewer (the earlier default);
- kvtui_omp_default: GOMP_SPINCOUNT=300000 (libgomp's default wait, as before kvtui set its own).
Target: kvtui / bare <= 1.10 (goal 1.03). The bare loop stamps its phases (imports, load, prefill, decode);
kvtui's entry point is stamped once imported and at exit.

Standalone: .venv/bin/python benchmarks/b_headless.py [--tokens N] [--repeats R] [--variants a,b] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, log, summary  # noqa: E402  (sets KVTUI_CACHE_DIR before anything loads a model)
from kvtui.engine.records.child import ENGINE_SPIN_COUNT  # noqa: E402

PROMPT = "Explain step by step how a KV cache speeds up text generation."

# A bare loop the way a user writes it, in its own process; it prints its tokens and its phases.
BARE = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
t_import = time.perf_counter()
path, prompt, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
t_load = time.perf_counter()
ids = tokenizer.apply_chat_template(
    [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
)["input_ids"]  # [1, n]
cache = DynamicCache(config=model.config)
chosen = []
with torch.inference_mode():
    logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits  # [1, n, vocab]
    t_prefill = time.perf_counter()
    for _ in range(n):
        token = int(logits[0, -1].argmax())
        chosen.append(token)
        if len(chosen) == n:
            break
        logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits
t_end = time.perf_counter()
print("BARE " + json.dumps({
    "prompt_ids": ids[0].tolist(), "chosen": chosen, "threads": torch.get_num_threads(),
    "import_s": t_import - t0, "load_s": t_load - t_import, "prefill_s": t_prefill - t_load,
    "decode_s": t_end - t_prefill,
}))
"""

# kvtui's entry point as the installed `kvtui` script runs it, with a stamp when its module is imported and at
# exit (atexit: after the summary is printed), so the process's wall time splits into start-up and the rest.
KVTUI = r"""
import atexit, sys, time
t0 = time.perf_counter()
from kvtui.cli import main
t_import = time.perf_counter()
atexit.register(lambda: print(f"KVTUI-STAMPS {t_import - t0} {time.perf_counter() - t0}", file=sys.stderr))
sys.argv[0] = "kvtui"
sys.exit(main())
"""


def model_dir() -> str:
    """The embedded SmolLM2's converted directory (converted once into KVTUI_CACHE_DIR if missing)."""
    from kvtui.engine.chat.loader import load_model

    return str(load_model(None, dtype="float32", device="cpu").path)


def _children_cpu() -> float:
    """CPU seconds (user + system, every thread) of the finished child processes so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _env(extra: dict | None = None) -> dict:
    """The children's environment: this tree first on the path, OpenMP's wait left to each process (libgomp's
    default for the bare loop, kvtui's own choice for kvtui) unless `extra` sets it."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    return {**env, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(extra or {})}


def run_bare(path: str, n: int, env: dict | None = None) -> dict:
    started, cpu = time.perf_counter(), _children_cpu()
    done = subprocess.run(
        [sys.executable, "-c", BARE, path, PROMPT, str(n)], capture_output=True, text=True, env=_env(env), check=False
    )
    wall, cpu = time.perf_counter() - started, _children_cpu() - cpu
    if done.returncode:
        raise RuntimeError(f"bare loop failed: {done.stderr.strip().splitlines()[-1:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("BARE "))
    return {"wall_s": wall, "cpu_s": cpu, **json.loads(line[5:])}


def run_kvtui(
    path: str, script: Path, n: int, trace: Path | None, extra: tuple[str, ...] = (), env: dict | None = None
) -> dict:
    args = [path, "--headless", "--script", str(script), "--max-new-tokens", str(n), *extra]
    if trace is not None:
        args += ["--trace", str(trace)]
    started, cpu = time.perf_counter(), _children_cpu()
    done = subprocess.run(
        [sys.executable, "-c", KVTUI, *args], capture_output=True, text=True, env=_env(env), check=False
    )
    wall, cpu = time.perf_counter() - started, _children_cpu() - cpu
    if done.returncode not in (0, 1):  # 1: an alarm at --fail-on's level fired; the run itself finished
        raise RuntimeError(f"kvtui --headless failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    stamps = next(x for x in done.stderr.splitlines() if x.startswith("KVTUI-STAMPS ")).split()[1:]
    out = {"wall_s": wall, "cpu_s": cpu, "import_s": float(stamps[0]), "in_process_s": float(stamps[1])}
    if trace is not None:
        out.update(_from_trace(trace))
    return out


def _from_trace(trace: Path) -> dict:
    """The chosen tokens, the fed prompt and the forwards' own timings, from the trace kvtui wrote."""
    steps = [r for r in map(json.loads, trace.read_text().splitlines()) if r.get("type") == "step"]
    prefill = steps[0]
    return {
        "prompt_ids": list(prefill.get("input_ids") or []),
        "chosen": [s["chosen"]["id"] for s in steps if s.get("chosen")],
        "forward_ms": [(s.get("ms") or {}).get("forward") for s in steps],
    }


VARIANTS = ("bare", "bare_short_spin", "kvtui", "kvtui_keep_core", "kvtui_omp_default")
LIBGOMP_DEFAULT = {"GOMP_SPINCOUNT": "300000"}  # libgomp's own spin count (OMP_WAIT_POLICY unset): a user's setting
SHORT_SPIN = {"GOMP_SPINCOUNT": str(ENGINE_SPIN_COUNT)}  # kvtui's own wait (records/child.py openmp_wait)


def bench(tokens: int = 96, repeats: int = 5, path: str | None = None, variants: tuple[str, ...] = VARIANTS) -> dict:
    """Every variant (the first must be "bare") once per repeat, the order rotated; see the module docstring."""
    import torch

    path = path or model_dir()
    threads = torch.get_num_threads()
    keep = ("--decode-threads", str(max(1, threads - 1)))
    with tempfile.TemporaryDirectory(prefix="kvtui-headless-") as tmp:
        script = Path(tmp) / "script.txt"
        script.write_text(PROMPT + "\n")
        # one untimed run of each with a trace: warms the file cache, and checks both make the same tokens
        checked = run_kvtui(path, script, tokens, Path(tmp) / "check.jsonl")
        n = len(checked["chosen"])
        bare = run_bare(path, n)
        same_prompt = checked["prompt_ids"] == bare["prompt_ids"]
        same_tokens = checked["chosen"] == bare["chosen"]
        log(f"  headless: {n} tokens; same prompt ids: {same_prompt}, same tokens as the bare loop: {same_tokens}")
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        loads = [os.getloadavg()[0]]
        for repeat in range(repeats):
            order = list(variants[repeat % len(variants) :] + variants[: repeat % len(variants)])
            for variant in order:
                if variant.startswith("bare"):
                    runs[variant].append(run_bare(path, n, SHORT_SPIN if variant == "bare_short_spin" else None))
                else:
                    runs[variant].append(
                        run_kvtui(
                            path,
                            script,
                            tokens,
                            None,
                            keep if variant == "kvtui_keep_core" else (),
                            LIBGOMP_DEFAULT if variant == "kvtui_omp_default" else None,
                        )
                    )
            loads.append(os.getloadavg()[0])
            log(
                f"  repeat {repeat + 1}/{repeats} (load average {loads[-1]:.2f}): "
                + ", ".join(f"{v} {runs[v][-1]['wall_s']:.2f} s" for v in variants)
            )
    bare_walls = [r["wall_s"] for r in runs["bare"]]
    return {
        "tokens": n,
        "threads": threads,
        "same_prompt_ids": same_prompt,
        "same_tokens": same_tokens,
        "repeats": repeats,
        "variants": list(variants),
        "wall_s": {v: summary([r["wall_s"] for r in runs[v]]) for v in variants},
        "ratio": {v: summary([r["wall_s"] / b for r, b in zip(runs[v], bare_walls)]) for v in variants[1:]},
        # like for like: kvtui against the bare loop whose OpenMP threads wait as kvtui's do (kvtui's own cost)
        "ratio_same_wait": summary([k["wall_s"] / b["wall_s"] for k, b in zip(runs["kvtui"], runs["bare_short_spin"])])
        if "bare_short_spin" in runs
        else None,
        "cpu_s": {v: summary([r["cpu_s"] for r in runs[v]]) for v in variants},
        "loadavg": loads,
        "bare_phases_s": {
            k: summary([r[k] for r in runs["bare"]]) for k in ("import_s", "load_s", "prefill_s", "decode_s")
        },
        "kvtui_import_s": summary([r["import_s"] for r in runs["kvtui"]]),
        "check_forward_ms": statistics.median(x for x in checked["forward_ms"][1:] if x is not None),
    }


def describe(result: dict) -> str:
    w, r = result["wall_s"], result["ratio"]
    others = {"kvtui_keep_core": "one decode thread fewer", "kvtui_omp_default": "libgomp's default wait"}
    return (
        f"kvtui --headless {w['kvtui']['median']:.2f} s, bare loop {w['bare']['median']:.2f} s "
        f"({result['tokens']} tokens, {result['threads']} threads): ratio {r['kvtui']['median']:.3f} "
        f"({r['kvtui']['min']:.3f}–{r['kvtui']['max']:.3f}); "
        + (
            f"like for like (bare loop with kvtui's OpenMP wait) {result['ratio_same_wait']['median']:.3f}; "
            if result.get("ratio_same_wait")
            else ""
        )
        + "".join(
            f"{label} {w[v]['median']:.2f} s, ratio {r[v]['median']:.3f}; " for v, label in others.items() if v in w
        )
        + f"same tokens: {result['same_tokens']}"
    )


def table(result: dict) -> list[str]:
    w, r, c = result["wall_s"], result["ratio"], result["cpu_s"]
    fmt = lambda s, d=2: f"{s['median']:.{d}f} ({s['min']:.{d}f}–{s['max']:.{d}f})"  # noqa: E731
    threads = result["threads"]
    names = {
        "bare": f"bare transformers greedy loop (own process, torch's {threads} threads, libgomp's default wait)",
        "bare_short_spin": f"the same bare loop with `GOMP_SPINCOUNT={ENGINE_SPIN_COUNT}` (kvtui's wait)",
        "kvtui": f"`kvtui MODEL --headless` as shipped (decodes on all {threads} threads)",
        "kvtui_keep_core": f"`kvtui MODEL --headless --decode-threads {max(1, threads - 1)}` (the earlier default)",
        "kvtui_omp_default": "`GOMP_SPINCOUNT=300000 kvtui MODEL --headless` (libgomp's default wait, as before)",
    }
    rows = [
        "| variant (whole process, spawn to exit) | wall s | ratio to bare (per repeat) | CPU s (all threads) |",
        "|---|---|---|---|",
    ]
    for v in result.get("variants", VARIANTS):
        ratio = "1" if v == "bare" else fmt(r[v], 3)
        rows.append(f"| {names[v]} | {fmt(w[v])} | {ratio} | {fmt(c[v])} |")
    phases = result["bare_phases_s"]
    loads = result["loadavg"]
    rows.append("")
    if result.get("ratio_same_wait"):
        rows.append(
            "Like for like (kvtui's own cost: kvtui / the bare loop with kvtui's OpenMP wait, per repeat): "
            f"{fmt(result['ratio_same_wait'], 3)}."
        )
        rows.append("")
    rows.append(
        f"{result['tokens']} tokens, the same in both (checked: {result['same_tokens']}); {result['repeats']} "
        f"repeats, order rotated; 1-minute load average {min(loads):.2f}–{max(loads):.2f}. Bare loop's phases "
        "(s, median): "
        + ", ".join(f"{k.removesuffix('_s')} {phases[k]['median']:.2f}" for k in phases)
        + f"; kvtui's entry point imports in {result['kvtui_import_s']['median']:.2f} s."
    )
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, bare first")
    parser.add_argument("--json", default=None, help="write the raw result here")
    args = parser.parse_args()
    found = bench(args.tokens, args.repeats, variants=tuple(args.variants.split(",")))
    print(describe(found))
    print("\n".join(table(found)))
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=1))

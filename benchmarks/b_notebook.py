"""7. The live notebook view: the same hand-written decode loop in a real Jupyter kernel (nbclient + ipykernel),
watched with no display and watched with display="live" (one output redrawn in place while the loop runs),
interleaved in each repeat; the ratio live / no display is per repeat, then the median (target: <= 1.05).
The unwatched loop runs too, for context. The model: the embedded SmolLM2 (or --tiny).

Standalone: .venv/bin/python benchmarks/b_notebook.py [--tiny] [--tokens N] [--repeats R] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import log, summary  # noqa: E402  (sets KVTUI_CACHE_DIR before the kernel starts)

SETUP = """
import json, os, tempfile, time, torch
from transformers import DynamicCache
import kvtui, kvtui.notebook
from kvtui.engine.chat.loader import load_model
from kvtui.engine.models.tiny import build_tiny
from transformers.utils import logging as hf_logging
hf_logging.disable_progress_bar()
MODEL = {model!r}
loaded = load_model(None if MODEL == "embedded" else str(build_tiny("llama", tempfile.mkdtemp())),
                    dtype="float32", device="cpu")
model, tokenizer = loaded.model, loaded.tokenizer
ids = tokenizer.apply_chat_template(
    [{{"role": "user", "content": "Explain step by step how a KV cache speeds up text generation."}}],
    add_generation_prompt=True, return_tensors="pt", return_dict=True,
)["input_ids"]

def loop(n):
    cache = DynamicCache(config=model.config)
    chosen = []
    with torch.inference_mode():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(n):
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            chosen.append(int(token))
    CPU.append(time.process_time() - cpu)  # the kernel process's CPU time: every thread, IOPub's included
    return time.perf_counter() - started, chosen
CPU = []
loop(4)  # warm up
"""

RUN = """
times = {{"plain": [], "watched": [], "live": []}}
cpu = {{"plain": [], "watched": [], "live": []}}
updates, render_s, same = [], [], True
for repeat in range({repeats}):
    order = ["plain", "watched", "live"] if repeat % 2 == 0 else ["live", "watched", "plain"]
    for variant in order:
        watch = None
        if variant != "plain":
            watch = kvtui.watch(model, tokenizer, display="live" if variant == "live" else None)
        seconds, chosen = loop({tokens})
        if watch is not None:
            live = kvtui.notebook.live_display(watch)
            if live is not None:
                updates.append(live.updates); render_s.append(live.render_s)
                live.close()
            watch.detach()
        times[variant].append(seconds)
        cpu[variant].append(CPU[-1])
        if variant == "plain":
            reference = chosen
        same = same and chosen == reference
print("KVTUI-BENCH " + json.dumps({{
    "times": times, "cpu": cpu, "updates": updates, "render_s": render_s, "same_tokens": same,
    "threads": torch.get_num_threads(), "model": f"{{loaded.source}} ({{type(model).__name__}})",
    "layers": model.config.num_hidden_layers,
}}))
"""


def bench(model: str = "embedded", tokens: int = 48, repeats: int = 5) -> dict:
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell(SETUP.format(model=model)),
        nbformat.v4.new_code_cell(RUN.format(repeats=repeats, tokens=tokens)),
    ]
    with tempfile.TemporaryDirectory(prefix="kvtui-bench-nb-") as work:
        NotebookClient(notebook, timeout=900, kernel_name="python3", resources={"metadata": {"path": work}}).execute()
    text = "".join(o.get("text", "") for o in notebook.cells[1].outputs if o.get("output_type") == "stream")
    raw = json.loads(text.split("KVTUI-BENCH ", 1)[1].splitlines()[0])
    times = raw["times"]
    live_ratio = [lv / w for lv, w in zip(times["live"], times["watched"])]
    return {
        "model": raw["model"],
        "layers": raw["layers"],
        "tokens": tokens,
        "repeats": repeats,
        "threads": raw["threads"],
        "ms_per_token": {k: summary([t * 1000 / tokens for t in v]) for k, v in times.items()},
        "ratio_live_vs_watched": summary(live_ratio),
        # CPU time of the kernel process (all its threads) per loop: what the live view costs, whatever else the
        # machine runs (wall-clock ratios on a shared 2-core VM swing by ±50 % between repeats)
        "cpu_ratio_live_vs_watched": summary([lv / w for lv, w in zip(raw["cpu"]["live"], raw["cpu"]["watched"])]),
        "draw_share": summary([r / t for r, t in zip(raw["render_s"], times["live"])]),
        "ratio_live_vs_plain": summary([lv / p for lv, p in zip(times["live"], times["plain"])]),
        "ratio_watched_vs_plain": summary([w / p for w, p in zip(times["watched"], times["plain"])]),
        "updates_per_loop": summary(raw["updates"]),
        "render_ms_per_loop": summary([r * 1000 for r in raw["render_s"]]),
        "updates_per_s": summary([u / t for u, t in zip(raw["updates"], times["live"])]),
        "same_tokens": raw["same_tokens"],
    }


def describe(r: dict) -> str:
    ms, ratio = r["ms_per_token"], r["ratio_live_vs_watched"]
    return (
        f"{r['model']} ({r['layers']} layers), {r['tokens']} tokens x {r['repeats']} repeats: "
        f"ms/token plain {ms['plain']['median']:.1f}, watched {ms['watched']['median']:.1f}, "
        f"watched + live display {ms['live']['median']:.1f}; live / watched {ratio['median']:.3f} "
        f"(min {ratio['min']:.3f}, max {ratio['max']:.3f}; target <= 1.05); "
        f"CPU time live / watched {r['cpu_ratio_live_vs_watched']['median']:.3f} "
        f"(min {r['cpu_ratio_live_vs_watched']['min']:.3f}, max {r['cpu_ratio_live_vs_watched']['max']:.3f}); "
        f"{r['updates_per_s']['median']:.1f} redraws/s, {r['render_ms_per_loop']['median']:.0f} ms drawing per loop "
        f"({r['draw_share']['median']:.1%} of the loop); "
        f"same tokens: {r['same_tokens']}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny random llama instead of SmolLM2")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    log("7. live notebook view in a real kernel")
    result = bench("tiny" if args.tiny else "embedded", args.tokens, args.repeats)
    log(describe(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

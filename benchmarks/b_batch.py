"""5b. Continuous batching watched: generate_batch's throughput plain vs watched (probe + trace) on the tiny llama.

Each forward packs several requests over a paged cache; kvtui reads it per request (every request a lane).
The two variants run interleaved per repeat; the ratio is per repeat, then the median."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from common import log, summary
from kvtui.engine.watch.probe import watch

SYSTEM = "You are a helpful assistant who answers briefly, politely and always in plain English."
QUESTIONS = ["What is a cache?", "Why do positions matter?", "Name a color.", "Count to three.", "Say hello."] * 2


def prompts_of(tokenizer) -> list[list[int]]:
    """Chat prompts sharing a system prompt, as a serving user sends them."""
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}], add_generation_prompt=True
            )["input_ids"]
        )
        for q in QUESTIONS
    ]


def run_batch(model, prompts: list[list[int]], n_new: int) -> tuple[float, int, dict]:
    """(seconds, tokens generated, {request: its tokens}) of one generate_batch."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = ContinuousBatchingConfig(page_size=16, max_batch_tokens=256, num_blocks=256)
    started = time.perf_counter()
    out = model.generate_batch(
        inputs=prompts,
        generation_config=GenerationConfig(max_new_tokens=n_new, do_sample=False),
        continuous_batching_config=config,
        progress_bar=False,
    )
    seconds = time.perf_counter() - started
    tokens = {rid: list(o.generated_tokens) for rid, o in out.items()}
    return seconds, sum(len(t) for t in tokens.values()), tokens


def bench(model, tokenizer, n_new: int = 32, repeats: int = 5) -> dict:
    if not hasattr(model, "generate_batch"):
        return {"skipped": "this transformers has no generate_batch"}
    prompts = prompts_of(tokenizer)
    run_batch(model, prompts, 4)  # warm-up
    plain, watched, same, steps = [], [], True, 0
    with tempfile.TemporaryDirectory(prefix="kvtui-batch-bench-") as tmp:
        for repeat in range(repeats):
            seconds, count, reference = run_batch(model, prompts, n_new)
            plain.append(count / seconds)
            with watch(model, tokenizer, trace=Path(tmp) / f"run{repeat}.jsonl") as watcher:
                seconds, count, tokens = run_batch(model, prompts, n_new)
            watched.append(count / seconds)
            same &= tokens == reference and not any(d.code == "position-gap" for d in watcher.diagnostics)
            steps = watcher.steps
            log(f"  repeat {repeat + 1}: plain {plain[-1]:.0f} tok/s, watched {watched[-1]:.0f} tok/s")
    return {
        "requests": len(prompts),
        "n_new": n_new,
        "forwards": steps,
        "plain_tok_s": summary(plain),
        "watched_tok_s": summary(watched),
        "slowdown": summary([p / w for p, w in zip(plain, watched)]),  # plain / watched throughput: ≥ 1
        "same_tokens": same,
    }


if __name__ == "__main__":  # this row alone: python benchmarks/b_batch.py
    from kvtui.engine.chat.loader import load_model
    from kvtui.engine.models.tiny import build_tiny

    with tempfile.TemporaryDirectory(prefix="kvtui-bench-") as _tmp:
        tiny = load_model(str(build_tiny("llama", Path(_tmp) / "tiny-llama")), dtype="float32", device="cpu")
        result = bench(tiny.model, tiny.tokenizer)
        s = result["slowdown"]
        log(
            f"generate_batch, {result['requests']} requests x {result['n_new']} tokens, {result['forwards']} forwards: "
            f"watched / plain time {s['median']:.3f} (min {s['min']:.3f}, max {s['max']:.3f}); "
            f"same tokens, no position-gap: {result['same_tokens']}"
        )

"""5. Watching a program: the same hand-written SmolLM2 decode loop unwatched, watched by kvtui.watch
(probe + trace file, headless), and unwatched again after detach (the hooks must be gone: cost 0).
The three variants run interleaved in each repeat; ratios are per repeat, then the median."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from common import log, summary
from kvtui.engine.watch.probe import watch

PROMPT = "Explain step by step how a KV cache speeds up text generation."


def user_loop(model, tokenizer, n_new: int, prompt: str = PROMPT) -> tuple[float, list[int]]:
    """A loop the way users write it: template ids, a DynamicCache, argmax, positions from the cache."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    cache = DynamicCache(config=model.config)
    chosen = []
    with torch.inference_mode():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        started = time.perf_counter()
        for _ in range(n_new):
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            chosen.append(int(token))
    return time.perf_counter() - started, chosen


def _hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _patches() -> int:
    from kvtui.engine.watch.patches import PATCHES

    return len(PATCHES.installed())


def bench(model, tokenizer, n_new: int = 48, repeats: int = 3) -> dict:
    baseline_hooks = _hooks(model)
    user_loop(model, tokenizer, 4)  # warm-up
    plain, watched, after, same = [], [], [], True
    with tempfile.TemporaryDirectory(prefix="kvtui-watch-bench-") as tmp:
        for repeat in range(repeats):
            seconds, reference = user_loop(model, tokenizer, n_new)
            plain.append(seconds)
            with watch(model, tokenizer, trace=Path(tmp) / f"run{repeat}.jsonl") as watcher:
                seconds, tokens = user_loop(model, tokenizer, n_new)
            watched.append(seconds)
            same &= tokens == reference and watcher.steps == n_new + 1
            seconds, tokens = user_loop(model, tokenizer, n_new)
            after.append(seconds)
            same &= tokens == reference
            log(
                f"  repeat {repeat + 1}: unwatched {plain[-1]:.2f} s, watched {watched[-1]:.2f} s, "
                f"after detach {after[-1]:.2f} s ({n_new} tokens)"
            )
    return {
        "n_new": n_new,
        "unwatched_s": summary(plain),
        "watched_s": summary(watched),
        "after_detach_s": summary(after),
        "watched_ratio": summary([w / p for w, p in zip(watched, plain)]),
        "after_ratio": summary([a / p for a, p in zip(after, plain)]),
        "same_tokens": same,
        "hooks_after_detach": _hooks(model) - baseline_hooks,
        "patches_after_detach": _patches(),
    }


if __name__ == "__main__":  # section 5 alone: python benchmarks/b_watch.py
    import tempfile as _tempfile

    from kvtui.engine.chat.loader import load_model
    from kvtui.engine.models.tiny import build_tiny

    with _tempfile.TemporaryDirectory(prefix="kvtui-bench-") as _tmp:
        tiny = load_model(str(build_tiny("llama", Path(_tmp) / "tiny-llama")), dtype="float32", device="cpu")
        smol = load_model(None, dtype="float32", device="cpu")
        for name, loaded, n in (("SmolLM2", smol, 48), ("tiny llama", tiny, 200)):
            result = bench(loaded.model, loaded.tokenizer, n_new=n, repeats=5)
            log(
                f"{name}: watched / unwatched {result['watched_ratio']['median']:.3f} "
                f"(min {result['watched_ratio']['min']:.3f}, max {result['watched_ratio']['max']:.3f}); after detach "
                f"{result['after_ratio']['median']:.3f}; same tokens {result['same_tokens']}; hooks left "
                f"{result['hooks_after_detach']}, patches left {result['patches_after_detach']}"
            )

"""5b. Attention capture (`kvtui.watch(model, tokenizer, attention=True)`, `--attention`): the same hand-written
SmolLM2 decode loop watched without and with attention, at a short and a long context, interleaved per repeat.
The capture's cost per step per layer is (watched with attention - watched) / tokens / layers; the model keeps
its own (sdpa) attention throughout, and the tokens must be the same in all variants."""

from __future__ import annotations

import time

import torch

from b_watch import PROMPT, user_loop
from common import log, summary
from kvtui.engine.watch.probe import watch


def decode(model, tokenizer, n_new: int, context: int) -> tuple[float, list[int]]:
    """b_watch's user loop on the prompt repeated to about `context` tokens."""
    return user_loop(model, tokenizer, n_new, " ".join([PROMPT] * max(1, context // 14)))


def bench(model, tokenizer, n_new: int = 32, repeats: int = 3, contexts=(64, 1024)) -> dict:
    layers = model.config.num_hidden_layers
    decode(model, tokenizer, 4, contexts[0])  # warm-up
    out: dict = {"n_new": n_new, "layers": layers, "implementation": model.config._attn_implementation, "rows": []}
    same = True
    for context in contexts:
        plain, watched, attention = [], [], []
        for repeat in range(repeats):
            seconds, reference = decode(model, tokenizer, n_new, context)
            plain.append(seconds)
            with watch(model, tokenizer):
                seconds, tokens = decode(model, tokenizer, n_new, context)
            watched.append(seconds)
            same &= tokens == reference
            with watch(model, tokenizer, attention=True) as watcher:
                seconds, tokens = decode(model, tokenizer, n_new, context)
                held = len(watcher.last.buffer)
            attention.append(seconds)
            same &= tokens == reference and watcher.last.attention is not None
            log(
                f"  context {held}, repeat {repeat + 1}: plain {plain[-1]:.2f} s, watched {watched[-1]:.2f} s, "
                f"watched with attention {attention[-1]:.2f} s ({n_new} tokens)"
            )
        per_layer = [(a - w) / n_new / layers * 1e6 for a, w in zip(attention, watched)]
        out["rows"].append(
            {
                "context": held,
                "plain_ms_per_step": summary([p / n_new * 1e3 for p in plain]),
                "watched_ms_per_step": summary([w / n_new * 1e3 for w in watched]),
                "attention_ms_per_step": summary([a / n_new * 1e3 for a in attention]),
                "attention_ratio_to_watched": summary([a / w for a, w in zip(attention, watched)]),
                "attention_ratio_to_plain": summary([a / p for a, p in zip(attention, plain)]),
                "us_per_step_per_layer": summary(per_layer),
            }
        )
    out["same_tokens"] = same
    out["isolated"] = isolated()
    return out


def isolated(contexts=(128, 1024, 4096), layers: int = 30, heads: int = 9, kv_heads: int = 3, steps: int = 40) -> list:
    """The capture's own work alone, SmolLM2's shapes (fp32, CPU): each layer's newest-query logits at every
    forward, then take() at the step's end (softmax, head means, tops, shares, the one transfer). No model runs,
    so the number does not move with the machine's load as much as a decode loop does."""
    from kvtui.engine.reading.attention import AttentionCapture, newest_scores
    from kvtui.engine.records.snapshot import BufferToken, TokenBuffer

    capture = AttentionCapture(torch.nn.Linear(1, 1))  # a module without attention layers: nothing registered
    capture.num_layers = layers
    rows = []
    try:
        for context in contexts:
            tokens = [BufferToken(i, 5, "x", i == 0, "user", 1) for i in range(context)]
            buffer = TokenBuffer(tokens)
            query = torch.randn(1, heads, 1, 64)
            keys = [torch.randn(1, kv_heads, context, 64) for _ in range(layers)]
            mask = torch.ones(1, 1, 1, context, dtype=torch.bool)
            times = []
            with torch.no_grad():
                for step in range(steps + 5):
                    started = time.perf_counter()
                    for layer in range(layers):
                        capture._rows[layer] = newest_scores(query, keys[layer], mask, 0.125)
                    capture.take(buffer, 1)
                    if step >= 5:
                        times.append((time.perf_counter() - started) * 1e6 / layers)
            rows.append({"context": context, "us_per_step_per_layer": summary(times)})
            log(f"  capture alone, {context} tokens: {summary(times)['median']:.0f} µs per step per layer")
    finally:
        capture.detach()
    return rows


def describe(result: dict) -> list[str]:
    lines = [
        f"SmolLM2 ({result['layers']} layers, {result['implementation']} attention kept), {result['n_new']} decode "
        "steps per run; medians [min–max]:",
        "",
        "| context (tokens) | plain ms/step | watched ms/step | watched + attention ms/step | attention / watched "
        "| µs per step per layer |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:

        def stat(s, digits=2):
            return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}–{s['max']:.{digits}f}]"

        lines.append(
            f"| {row['context']} | {stat(row['plain_ms_per_step'])} | {stat(row['watched_ms_per_step'])} | "
            f"{stat(row['attention_ms_per_step'])} | {stat(row['attention_ratio_to_watched'], 3)} | "
            f"{stat(row['us_per_step_per_layer'], 0)} |"
        )
    lines += ["", f"Greedy tokens identical in every variant: {result['same_tokens']}."]
    if result.get("isolated"):
        lines += [
            "",
            "The capture's own work alone (each layer's newest-query logits, then the step's softmax, head means, "
            "tops, shares and one transfer; SmolLM2's shapes, fp32 CPU, no model running):",
            "",
            "| context (tokens) | µs per step per layer |",
            "|---|---|",
        ]
        lines += [
            f"| {row['context']} | {row['us_per_step_per_layer']['median']:.0f} "
            f"[{row['us_per_step_per_layer']['min']:.0f}–{row['us_per_step_per_layer']['max']:.0f}] |"
            for row in result["isolated"]
        ]
    return lines


if __name__ == "__main__":  # this section alone: python benchmarks/b_attention.py
    from kvtui.engine.chat.loader import load_model

    smol = load_model(None, dtype="float32", device="cpu")
    for line in describe(bench(smol.model, smol.tokenizer, n_new=24, repeats=3, contexts=(64, 512))):
        log(line)

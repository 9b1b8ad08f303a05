"""1. Inspection overhead: ChatSession.step (full snapshot + diagnostics) vs a bare transformers loop vs
model.generate, same model, same cache kind, same greedy tokens, interleaved per repeat."""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

from common import in_worker, log, summary
from kvtui.engine.chat.session import ChatSession, SessionConfig
from kvtui.engine.reading import introspect

PROMPT = "Explain step by step how a KV cache speeds up text generation."


def run_engine(model, tokenizer, prompt: str, n_new: int) -> dict:
    """send() (prefill) + n_new-1 step()s: n_new chosen tokens, each with a full StepSnapshot."""
    session = ChatSession(model, tokenizer, SessionConfig(max_new_tokens=10**9))
    session.stop_ids = frozenset()  # no early stop at EOS: every variant makes exactly n_new tokens
    t0 = time.perf_counter()
    first = session.send(prompt)
    t1 = time.perf_counter()
    snaps = [session.step() for _ in range(n_new - 1)]
    t2 = time.perf_counter()
    prompt_ids = list(first.input_ids)
    ids = [first.chosen.id] + [s.chosen.id for s in snaps]
    return {
        "prefill_s": t1 - t0,
        "decode_s": t2 - t1,
        "prompt_ids": prompt_ids,
        "ids": ids,
        "snapshot_ms": [s.snapshot_ms for s in snaps],
        "forward_ms": [s.forward_ms for s in snaps],
        "cache_bytes": snaps[-1].cache_bytes if snaps else first.cache_bytes,
    }


def run_bare(model, prompt_ids: list[int], ids: list[int]) -> dict:
    """The same forwards with nothing around them: DynamicCache(config=...), explicit position ids,
    logits_to_keep=1, argmax; feeds the engine's tokens (and checks it would have chosen them)."""
    cache = DynamicCache(config=model.config)
    accepts_cp = introspect.forward_accepts(model, "cache_position")
    accepts_keep = introspect.forward_accepts(model, "logits_to_keep")
    extra = {"logits_to_keep": 1} if accepts_keep else {}
    n = len(prompt_ids)
    chosen = []
    with torch.inference_mode():
        t0 = time.perf_counter()
        kwargs = dict(
            input_ids=torch.tensor([prompt_ids]),
            position_ids=torch.arange(n).unsqueeze(0),
            past_key_values=cache,
            use_cache=True,
            **extra,
        )
        if accepts_cp:
            kwargs["cache_position"] = torch.arange(n)
        out = model(**kwargs)
        chosen.append(int(torch.argmax(out.logits[0, -1])))
        t1 = time.perf_counter()
        for i, token in enumerate(ids[:-1]):
            pos = n + i
            kwargs = dict(
                input_ids=torch.tensor([[token]]),
                position_ids=torch.tensor([[pos]]),
                past_key_values=cache,
                use_cache=True,
                **extra,
            )
            if accepts_cp:
                kwargs["cache_position"] = torch.tensor([pos])
            out = model(**kwargs)
            chosen.append(int(torch.argmax(out.logits[0, -1])))
        t2 = time.perf_counter()
    return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "ids": chosen}


class _TimingStreamer(BaseStreamer):
    """Timestamps every put(): the first is the prompt, then one per new token."""

    def __init__(self):
        self.times: list[float] = []
        self.tokens: list[int] = []
        self._prompt_seen = False

    def put(self, value):
        now = time.perf_counter()
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(now)
        self.tokens.extend(int(v) for v in value.reshape(-1).tolist())

    def end(self):
        pass


def run_generate(model, prompt_ids: list[int], n_new: int) -> dict:
    streamer = _TimingStreamer()
    input_ids = torch.tensor([prompt_ids])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=n_new,
            min_new_tokens=None,
            do_sample=False,
            eos_token_id=None,
            streamer=streamer,
            pad_token_id=0,
            top_k=None,
            top_p=None,
            temperature=None,
        )
    t2 = time.perf_counter()
    ids = out[0, len(prompt_ids) :].tolist()
    t1 = streamer.times[0] if streamer.times else t2
    last = streamer.times[-1] if streamer.times else t2
    return {"prefill_s": t1 - t0, "decode_s": last - t1, "total_s": t2 - t0, "ids": ids}


def run_paired(model, tokenizer, prompt: str, n_new: int) -> dict:
    """Engine and bare loop advanced token by token in alternation (order flipped every token), each with
    its own cache: a burst of background load hits both sides of a pair, so the per-token ratio is
    robust on a shared machine."""
    session = ChatSession(model, tokenizer, SessionConfig(max_new_tokens=10**9))
    session.stop_ids = frozenset()
    first = session.send(prompt)
    prompt_ids = list(first.input_ids)
    cache = DynamicCache(config=model.config)
    accepts_cp = introspect.forward_accepts(model, "cache_position")
    extra = {"logits_to_keep": 1} if introspect.forward_accepts(model, "logits_to_keep") else {}
    n = len(prompt_ids)

    def bare_forward(ids, start):
        kwargs = dict(
            input_ids=torch.tensor([ids]),
            position_ids=torch.arange(start, start + len(ids)).unsqueeze(0),
            past_key_values=cache,
            use_cache=True,
            **extra,
        )
        if accepts_cp:
            kwargs["cache_position"] = torch.arange(start, start + len(ids))
        with torch.inference_mode():
            return int(torch.argmax(model(**kwargs).logits[0, -1]))

    token = bare_forward(prompt_ids, 0)
    agree = token == first.chosen.id
    engine_ms, bare_ms = [], []
    for i in range(n_new - 1):
        feed = session.pending.id
        for side in (0, 1) if i % 2 == 0 else (1, 0):
            t0 = time.perf_counter()
            if side == 0:
                snap = session.step()
                engine_ms.append((time.perf_counter() - t0) * 1000)
            else:
                token = bare_forward([feed], n + i)
                bare_ms.append((time.perf_counter() - t0) * 1000)
        agree &= token == snap.chosen.id
    return {"engine_ms": engine_ms, "bare_ms": bare_ms, "agree": agree}


def bench(
    model, tokenizer, label: str, n_new: int, repeats: int, warmup: int = 1, prompt: str = PROMPT, paired_runs: int = 2
) -> dict:
    """Interleave the three variants in every repeat (rotating their order) to cancel drift."""
    variants = ["engine", "bare", "generate"]
    rows: dict[str, list[dict]] = {v: [] for v in variants}
    ref = None
    agree = {"bare": True, "generate": True}
    for rep in range(warmup + repeats):
        order = variants[rep % 3 :] + variants[: rep % 3]
        results = {}
        for variant in order:
            # every run in a fresh thread, as the TUI runs the engine (see common.thread_probe)
            if variant == "engine":
                results[variant] = in_worker(run_engine, model, tokenizer, prompt, n_new)
                if ref is None:
                    ref = results[variant]
            else:
                if ref is None:  # the engine defines the prompt ids and tokens: run it first once
                    ref = in_worker(run_engine, model, tokenizer, prompt, n_new)
                if variant == "bare":
                    results[variant] = in_worker(run_bare, model, ref["prompt_ids"], ref["ids"])
                else:
                    results[variant] = in_worker(run_generate, model, ref["prompt_ids"], n_new)
        for variant in ("bare", "generate"):
            agree[variant] &= results[variant]["ids"] == ref["ids"]
        if rep >= warmup:
            for variant in variants:
                rows[variant].append(results[variant])
        dec = {v: (n_new - 1) / results[v]["decode_s"] for v in variants}
        log(
            f"  {label} rep {rep + 1}/{warmup + repeats}{' (warm-up)' if rep < warmup else ''}: decode tok/s "
            + ", ".join(f"{v} {dec[v]:.1f}" for v in variants)
        )

    def tps(variant, kind):
        out = []
        for r in rows[variant]:
            if kind == "decode":
                out.append((n_new - 1) / r["decode_s"])
            else:
                out.append(n_new / (r["prefill_s"] + r["decode_s"]))
        return out

    result = {
        "label": label,
        "n_new": n_new,
        "prompt_tokens": len(ref["prompt_ids"]),
        "repeats": repeats,
        "warmup": warmup,
        "tokens_agree": agree,
        "cache_bytes": ref["cache_bytes"],
        "variants": {},
    }
    for variant in variants:
        result["variants"][variant] = {
            "decode_tps": summary(tps(variant, "decode")),
            "e2e_tps": summary(tps(variant, "e2e")),
            "prefill_ms": summary([r["prefill_s"] * 1000 for r in rows[variant]]),
            "decode_ms_per_token": summary([r["decode_s"] * 1000 / (n_new - 1) for r in rows[variant]]),
        }
    # side-by-side ratios: per repeat, then the median of the ratios
    result["ratio_engine_vs_bare"] = summary(
        [e["decode_s"] / b["decode_s"] for e, b in zip(rows["engine"], rows["bare"])]
    )
    result["ratio_engine_vs_generate"] = summary(
        [e["decode_s"] / g["decode_s"] for e, g in zip(rows["engine"], rows["generate"])]
    )
    result["ratio_bare_vs_generate"] = summary(
        [b["decode_s"] / g["decode_s"] for b, g in zip(rows["bare"], rows["generate"])]
    )
    result["ratio_engine_vs_bare_e2e"] = summary(
        [
            (e["prefill_s"] + e["decode_s"]) / (b["prefill_s"] + b["decode_s"])
            for e, b in zip(rows["engine"], rows["bare"])
        ]
    )
    result["ratio_engine_vs_bare_fastest"] = min(r["decode_s"] for r in rows["engine"]) / min(
        r["decode_s"] for r in rows["bare"]
    )
    result["ratio_engine_vs_generate_fastest"] = min(r["decode_s"] for r in rows["engine"]) / min(
        r["decode_s"] for r in rows["generate"]
    )
    paired = [in_worker(run_paired, model, tokenizer, prompt, n_new) for _ in range(paired_runs)]
    if paired:
        ratios = [e / b for run in paired for e, b in zip(run["engine_ms"], run["bare_ms"])]
        result["paired"] = {
            "runs": paired_runs,
            "tokens": len(ratios),
            "ratio_per_token": summary(ratios),
            "ratio_of_sums": sum(sum(run["engine_ms"]) for run in paired) / sum(sum(run["bare_ms"]) for run in paired),
            "engine_ms": summary([x for run in paired for x in run["engine_ms"]]),
            "bare_ms": summary([x for run in paired for x in run["bare_ms"]]),
            "agree": all(run["agree"] for run in paired),
        }
        log(
            f"  {label} paired per token: engine/bare median {result['paired']['ratio_per_token']['median']:.3f}, "
            f"ratio of sums {result['paired']['ratio_of_sums']:.3f} over {len(ratios)} token pairs"
        )
    snap = [ms for r in rows["engine"] for ms in r["snapshot_ms"]]
    fwd = [ms for r in rows["engine"] for ms in r["forward_ms"]]
    result["engine_snapshot_ms"] = summary(snap)
    result["engine_forward_ms"] = summary(fwd)
    return result

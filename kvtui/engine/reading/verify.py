"""Verify: the cached last logits against one no-cache forward over the same tokens. One verdict, one
recompute and one alarm for kvtui's own cache and a watched program's (chat/session.py, watch/probe.py)."""

from __future__ import annotations

import math
import time

import torch

from ..records.snapshot import Diagnostic, VerifyResult
from . import introspect

# Absolute tolerance on logits for `verify`, by dtype of the model.
VERIFY_TOLERANCE = {"float32": 1e-4, "float64": 1e-8, "bfloat16": 0.5, "float16": 0.1}


def recompute_last_logits(
    model, tokens: list[int], logits_to_keep: bool = False, threads=None, clock=time.perf_counter, kept=None
) -> tuple[torch.Tensor, float]:
    """One no-cache forward over `tokens` at positions 0..n-1 (what `model(ids)` does): its last logits
    [vocab] in float32 and the milliseconds it took. `threads`: a context manager to
    run it under; `clock`: the caller's (a session's is injectable for stable screenshots); `kept`: a list that gets
    the full-precision cache the model made for this forward (its K/V, for `quantized_errors`; none is passed in)."""
    from contextlib import nullcontext

    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([tokens], device=device)  # [1, n]
    kwargs = dict(input_ids=ids, use_cache=False, position_ids=torch.arange(len(tokens), device=device).unsqueeze(0))
    if kept is not None:
        kwargs["use_cache"] = True  # the model makes its own DynamicCache and returns it
    if logits_to_keep:
        kwargs["logits_to_keep"] = 1
    started = clock()
    with torch.inference_mode(), threads or nullcontext():
        output = model(**kwargs)
        fresh = output.logits[0, -1].float()  # [vocab]
    if kept is not None:
        kept.append(introspect.output_cache(output))
    return fresh, (clock() - started) * 1000


def quantized_errors(cache, fresh) -> tuple[tuple[float, float], ...]:
    """Per layer of a quantized `cache`, how far the K and V attention gets (dequantized, its residual included)
    are from the full-precision recompute's (`fresh`, the same tokens at the same positions): the largest absolute
    difference over the largest absolute value of the recompute's, K then V (0.01: off by up to 1 % of the
    range). A layer that is not quantized or not comparable (another length) gives (nan, nan)."""
    out = []
    for layer, reference in zip(cache.layers, fresh.layers, strict=False):
        held = introspect.dequantized_kv(layer)
        keys, values = getattr(reference, "keys", None), getattr(reference, "values", None)
        if held is None or keys is None or held[0].shape != keys.shape:
            out.append((math.nan, math.nan))
            continue
        pair = []
        for mine, truth in zip(held, (keys, values), strict=True):
            truth = truth.float()
            scale = float(truth.abs().max()) or 1.0
            pair.append(float((mine.float().to(truth.device) - truth).abs().max()) / scale)
        out.append((pair[0], pair[1]))
    return tuple(out)


def compression_cost(cached: torch.Tensor, fresh: torch.Tensor) -> tuple[float, bool]:
    """What a compressed cache costs one step: KL(full ‖ compressed) of the next-token distributions, in nats, and
    whether both pick the same top-1 ([vocab] logits each; `fresh` from the uncompressed recompute)."""
    full = torch.log_softmax(fresh.detach().float(), -1)  # a program's logits may carry autograd: only values
    compressed = torch.log_softmax(cached.detach().float().to(full.device), -1)
    kl = float((full.exp() * (full - compressed)).sum())
    return max(kl, 0.0), int(fresh.argmax()) == int(cached.argmax())


def cost_note(costs: list[tuple[float, bool]], who: str, held: int, tokens: int, step: int) -> Diagnostic:
    """The `compression-cost` note of a verify on a compressed cache: this verify's (KL, top-1 agrees), the last of
    `costs`, and the run's; `who` names the cache, `held` the most slots a layer holds, `tokens` the tokens fed."""
    kl, top1 = costs[-1]
    agree = sum(1 for _, same in costs if same)
    mean = sum(k for k, _ in costs) / len(costs)
    return Diagnostic(
        "compression-cost",
        "info",
        f"{who} holds at most {held} of {tokens} fed tokens per layer: against the uncompressed "
        f"recompute the next token {'agrees' if top1 else 'differs'} (top-1), KL(full ‖ compressed) {kl:.4g} nats; "
        f"over the run {agree}/{len(costs)} verifies agree on top-1, mean KL {mean:.4g}",
        step,
    )


def mismatch_alarm(result: VerifyResult, what: str, step: int, bound: str = "", tail: str = "") -> Diagnostic:
    """The `cache-mismatch` error of a failed verify; `what` names the logits ("cached logits", "the
    program's cached logits (DynamicCache#1)"); `bound` says which tolerance, `tail` what else explains it."""
    return Diagnostic(
        "cache-mismatch",
        "error",
        f"{what} differ from a full recompute of {result.tokens} tokens: max |diff| {result.max_abs_diff:.3g} "
        f"> {result.tolerance:g}{bound}{'' if result.topk_agree else ', top-k order differs'}{tail}",
        step,
    )


def judge_recompute(
    cached: torch.Tensor, fresh: torch.Tensor, dtype: str, k: int, tokens: int, ms: float, quant_bits: int | None = None
) -> VerifyResult:
    """The one verdict of verify, for kvtui's own cache and a watched program's: cached vs recomputed
    last logits ([vocab] each) within the dtype's tolerance (a quantized cache's bound when bits are
    given), and the same top-k order, near-ties aside."""
    fresh, cached = fresh.float(), cached.float().to(fresh.device)
    diff = float((fresh - cached).abs().max())
    tolerance = VERIFY_TOLERANCE.get(dtype, 1e-3)
    if quant_bits is not None:  # lossy by design: the bound scales with the logits' range and the bits kept
        tolerance = max(tolerance, quantized_tolerance(quant_bits, fresh))
    cached_top = torch.topk(cached, k).indices.tolist()
    fresh_top = torch.topk(fresh, k).indices.tolist()
    agree = _orders_agree(cached_top, fresh_top, fresh, tolerance)
    return VerifyResult(
        max_abs_diff=diff,
        tolerance=tolerance,
        topk_agree=agree,
        cached_top=tuple(cached_top),
        recomputed_top=tuple(fresh_top),
        tokens=tokens,
        ok=diff <= tolerance and agree,
        ms=ms,
    )


def quantized_tolerance(bits: int, fresh_logits: torch.Tensor) -> float:
    """What verify allows a quantized cache: 2**-(bits-1) of the recomputed logits' range.

    A heuristic, not a proof: per-group quantization to b bits rounds each value by up to half a step
    (2**-b of its group's range); attention and the layers after it mix those errors, so the bound on
    the logits is taken one bit looser, relative to their own spread. fp8 (e4m3) keeps 3 mantissa bits."""
    spread = float(fresh_logits.max() - fresh_logits.min())
    return spread * 2.0 ** -(bits - 1)


def _orders_agree(cached: list[int], fresh: list[int], fresh_logits: torch.Tensor, tolerance: float) -> bool:
    """Same top-k order, treating tokens whose recomputed logits are within tolerance as ties."""
    if set(cached) != set(fresh):
        # a different member is fine only if it is tied with the k-th at the boundary
        kth = float(fresh_logits[fresh[-1]])
        return all(abs(float(fresh_logits[i]) - kth) <= tolerance for i in set(cached) ^ set(fresh))
    return all(
        a == b or abs(float(fresh_logits[a]) - float(fresh_logits[b])) <= tolerance for a, b in zip(cached, fresh)
    )

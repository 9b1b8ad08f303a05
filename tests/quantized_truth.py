"""An independent measure of a quantized cache's per-layer error, for the verify tests (kvtui's own chat and a
watched program): what attention really gets from the cache, asked of the cache's own `update()` with no new token
(transformers dequantizes and joins its residual itself), against the K/V of a full-precision recompute."""

from __future__ import annotations

import torch


def quantization_errors(model, cache, ids: list[int]) -> tuple[tuple[float, float], ...]:
    """Per layer: max |K (V) attention gets - the recompute's| / max |the recompute's|. Calls `update` on `cache`
    (a quanto tensor has no deepcopy): with nothing new and its residual below its flush length, nothing is
    re-quantized, only joined again; use it last."""
    from transformers import DynamicCache

    fresh = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]), past_key_values=fresh, use_cache=True)  # [1, n]
    out = []
    for layer, reference in zip(cache.layers, fresh.layers, strict=True):
        keys, values = layer.update(reference.keys[:, :, :0], reference.values[:, :, :0])  # [1, heads, 0, dim] new
        pair = []
        for mine, truth in ((keys, reference.keys), (values, reference.values)):
            pair.append(float((mine.float() - truth.float()).abs().max()) / float(truth.float().abs().max()))
        out.append(tuple(pair))
    return tuple(out)

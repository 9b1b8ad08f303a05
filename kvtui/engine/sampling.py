"""Logits -> processed scores -> token, with transformers' own LogitsProcessors (nothing re-written)."""

from __future__ import annotations

import torch
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .settings import SamplerSettings  # noqa: F401  (re-exported: the sampler's settings live with it)
from .snapshot import TopToken


class Sampler:
    """Applies the processors in generate()'s order and draws from a seeded generator."""

    def __init__(self, settings: SamplerSettings, device: torch.device | str = "cpu"):
        self.settings = settings
        processors = []
        if settings.repetition_penalty != 1:
            processors.append(RepetitionPenaltyLogitsProcessor(settings.repetition_penalty))
        if not settings.greedy:
            if settings.temperature != 1:
                processors.append(TemperatureLogitsWarper(settings.temperature))
            if settings.top_k:
                processors.append(TopKLogitsWarper(settings.top_k))
            if settings.top_p < 1:
                processors.append(TopPLogitsWarper(settings.top_p))
        self.processors = LogitsProcessorList(processors)
        self.generator = torch.Generator(device=device)
        if settings.seed is not None:
            self.generator.manual_seed(settings.seed)
        else:
            self.generator.seed()

    @property
    def needs_history(self) -> bool:
        """Only the repetition penalty reads earlier ids (building them costs O(cache))."""
        return self.settings.repetition_penalty != 1

    def process(self, history: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """history: [1, n] ids (or [1, 0]); logits: [vocab] float -> scores: [vocab]."""
        if not self.processors:
            return logits
        return self.processors(history, logits.unsqueeze(0))[0]

    def choose(self, scores: torch.Tensor) -> int:
        if self.settings.greedy:
            return int(torch.argmax(scores))
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def top_tokens(scores: torch.Tensor, k: int, piece) -> tuple[TopToken, ...]:
    """The k highest tokens of scores [vocab] with their softmax probabilities (k small: .tolist())."""
    probs = torch.softmax(scores, dim=-1)
    k = min(k, scores.shape[-1])
    top_probs, top_ids = torch.topk(probs, k)
    top_logits = scores[top_ids]
    return tuple(
        TopToken(id=i, text=piece(i), logit=_finite(lg), prob=p, rank=r + 1)
        for r, (i, lg, p) in enumerate(zip(top_ids.tolist(), top_logits.tolist(), top_probs.tolist()))
        if p > 0 or r == 0
    )


def watched_tokens(scores: torch.Tensor, ids, piece) -> tuple[TopToken, ...]:
    """Probability and rank of chosen ids wherever they fall in the distribution."""
    if not ids:
        return ()
    probs = torch.softmax(scores, dim=-1)
    out = []
    for token_id in ids:
        if not 0 <= token_id < scores.shape[-1]:
            continue
        prob = probs[token_id]
        rank = int((probs > prob).sum()) + 1  # O(vocab), on the device
        out.append(TopToken(id=token_id, text=piece(token_id), logit=_finite(float(scores[token_id])), prob=float(prob), rank=rank))
    return tuple(out)


def _finite(value: float) -> float:
    # -inf from a top-k/top-p mask is not JSON: keep it as a very negative number.
    return value if value > -1e30 else -1e30

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

from ..reading.topk import chosen_from_top, top_token_rows, top_tokens, watched_tokens  # noqa: F401  (re-exported)
from ..records.snapshot import TopToken
from .settings import SamplerSettings  # noqa: F401  (re-exported: the sampler's settings live with it)


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

    def choose(self, scores: torch.Tensor, top: tuple[TopToken, ...] = ()) -> int:
        """The next token; `top`: scores' top tokens, when known (greedy reads them unless the first two tie,
        where argmax's first-index rule decides, as generate()'s does)."""
        if self.settings.greedy:
            if len(top) == 1 or (len(top) > 1 and top[0].logit > top[1].logit):
                return top[0].id
            return int(torch.argmax(scores))
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))

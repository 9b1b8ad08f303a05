"""Logits -> processed scores -> token, with transformers' own LogitsProcessors (nothing re-written)."""

from __future__ import annotations

import math

import torch
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

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


def top_tokens(scores: torch.Tensor, k: int, piece) -> tuple[TopToken, ...]:
    """The k highest tokens of scores [vocab] with their softmax probabilities."""
    return top_token_rows(scores.unsqueeze(0), k, piece)[0]


def top_token_rows(scores: torch.Tensor, k: int, piece) -> list[tuple[TopToken, ...]]:
    """Per row of scores [rows, vocab]: its k highest tokens with their softmax probabilities.

    One top-k, one log-softmax, one gather and one transfer to the host for every row together: a
    probability is exp(log-softmax). logsumexp would name the normaliser without a vocab-sized tensor, but on
    the CPU it is several kernels where log_softmax is one: measured after a forward on a 3-layer model
    (the state a step's inspection runs in), topk + logsumexp took ~100 µs and topk + log_softmax + gather
    ~45 µs. The order is topk's on the scores themselves (a shifted copy could round two logits into a tie)."""
    rows, vocab = scores.shape
    k = min(k, vocab)
    if scores.dtype != torch.float32:
        scores = scores.float()
    values, ids = torch.topk(scores, k)  # [rows, k]
    logprobs = torch.log_softmax(scores, dim=-1).gather(-1, ids)  # [rows, k]
    if scores.device.type != "cpu" and vocab < 2**24:  # one device -> host transfer (ids exact in float32)
        host = torch.cat((values, logprobs, ids.to(torch.float32)), dim=-1).tolist()  # [rows, 3k]
        found = [(row[:k], row[k : 2 * k], [int(i) for i in row[2 * k :]]) for row in host]
    else:  # on the CPU reading three small tensors costs less than building one
        found = list(zip(values.tolist(), logprobs.tolist(), ids.tolist()))
    out = []
    for logits, row_logprobs, row_ids in found:
        tops = []
        for rank, (token_id, logit, logprob) in enumerate(zip(row_ids, logits, row_logprobs)):
            # a NaN (a broken model) fails the test: 0, never a NaN in the trace
            prob = math.exp(logprob) if logprob > -math.inf else 0.0
            if prob > 0 or rank == 0:
                tops.append(TopToken(token_id, piece(token_id), _finite(logit), prob, rank + 1))
        out.append(tuple(tops))
    return out


def chosen_from_top(top: tuple[TopToken, ...], token_id: int) -> TopToken | None:
    """The chosen token's TopToken when it is among the top ones (its rank: 1 + how many score above it),
    else None (then its rank needs the whole distribution)."""
    for token in top:
        if token.id == token_id:
            rank = 1 + sum(1 for other in top if other.logit > token.logit)
            return token if rank == token.rank else TopToken(token.id, token.text, token.logit, token.prob, rank)
    return None


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
        out.append(
            TopToken(
                id=token_id, text=piece(token_id), logit=_finite(float(scores[token_id])), prob=float(prob), rank=rank
            )
        )
    return tuple(out)


def _finite(value: float) -> float:
    # -inf from a top-k/top-p mask is not JSON: keep it as a very negative number.
    return value if value > -1e30 else -1e30

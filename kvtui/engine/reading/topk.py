"""The top-k of a forward's logits and the rank of chosen ids: read the same way for kvtui's own chat and a
watched program (what the top-k pane shows). Shapes: scores [vocab] or [rows, vocab]."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import fields
from itertools import chain, repeat

import torch

from ..records.snapshot import TopToken


def top_tokens(scores: torch.Tensor, k: int, piece) -> tuple[TopToken, ...]:
    """The k highest tokens of scores [vocab] with their softmax probabilities."""
    return top_token_rows(scores.unsqueeze(0), k, piece)[0]


def top_token_rows(scores: torch.Tensor, k: int, piece) -> list[tuple[TopToken, ...]]:
    """Per row of scores [rows, vocab]: its k highest tokens with their softmax probabilities.

    One top-k, one logsumexp, one subtraction and one transfer to the host for every row together: a
    probability is exp(logit - logsumexp). The order is topk's on the scores themselves (a shifted copy could
    round two logits into a tie)."""
    vocab = scores.shape[-1]
    values, logprobs, ids = top_tensors(scores, k)
    k = values.shape[-1]
    if scores.device.type != "cpu" and vocab < 2**24:  # one device -> host transfer (ids exact in float32)
        host = torch.cat((values, logprobs, ids.to(torch.float32)), dim=-1).tolist()  # [rows, 3k]
        found = [(row[:k], row[k : 2 * k], [int(i) for i in row[2 * k :]]) for row in host]
    else:  # on the CPU reading three small tensors costs less than building one
        found = list(zip(values.tolist(), logprobs.tolist(), ids.tolist()))
    return _top_rows(found, piece)


def top_tensors(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """top_token_rows' device part, nothing read: each row's k highest logits [rows, k] float32, their
    log-probabilities [rows, k] float32 and their ids [rows, k]; three ops (topk, logsumexp, sub). For a
    caller that reads them with its other tensors in one transfer (`introspect.HostReads`, which joins them:
    no cat of their own); `top_rows_from` makes the TopTokens of what it read."""
    k = min(k, scores.shape[-1])
    if scores.dtype != torch.float32:
        scores = scores.float()
    values, ids = torch.topk(scores, k)  # [rows, k]
    # logsumexp, not log_softmax: its sum is torch.sum's (cascaded), accurate to ~1e-6 at a 152k vocab in
    # float32, where log_softmax's running sum was off by up to 4e-5 (an AVX2 CPU; the kernel decides), for
    # ~45 µs more a step on the CPU (measured beside it at 49k: 215 vs 170 µs with the topk)
    logprobs = values - torch.logsumexp(scores, dim=-1, keepdim=True)  # [rows, k]
    return values, logprobs, ids


def top_rows_from(
    logits: list[list[float]], logprobs: list[list[float]], ids: list[list[int]], piece, pieces=None
) -> list[tuple[TopToken, ...]]:
    """The TopTokens of what top_tensors gave, read: logits, logprobs and ids [rows][k]. `pieces(ids)`: the
    pieces of a row's ids at once (TokenTexts.pieces_of), the same as `piece` of each."""
    return _top_rows(zip(logits, logprobs, ids), piece, pieces)


def top_row_from(
    logits: list[float], logprobs: list[float], ids: list[int], piece, pieces=None
) -> tuple[TopToken, ...]:
    """`top_rows_from` of one row (a batch of one: no loop over rows)."""
    fast = _fast_row(logits, logprobs, ids, piece, pieces)
    return fast if fast is not None else _checked_row(logits, logprobs, ids, piece)


def _top_rows(found, piece, pieces=None) -> list[tuple[TopToken, ...]]:
    """(logits, log-probabilities, ids) per row -> its TopTokens."""
    out = []
    for logits, row_logprobs, row_ids in found:
        fast = _fast_row(logits, row_logprobs, row_ids, piece, pieces)
        out.append(fast if fast is not None else _checked_row(logits, row_logprobs, row_ids, piece))
    return out


def _checked_row(logits: list[float], logprobs: list[float], ids: list[int], piece) -> tuple[TopToken, ...]:
    """A row with a -inf, a NaN or a masked logit: each token as it is, those of probability 0 left out (but the
    first)."""
    tops = []
    for rank, (token_id, logit, logprob) in enumerate(zip(ids, logits, logprobs)):
        # a NaN (a broken model) fails the test: 0, never a NaN in the trace
        prob = math.exp(logprob) if logprob > -math.inf else 0.0
        if prob > 0 or rank == 0:
            tops.append(TopToken(token_id, piece(token_id), _finite(logit), prob, rank + 1))
    return tuple(tops)


# TopToken's slots' setters, in field order (id, text, logit, prob, rank): the row's tokens are filled field by
# field in C-level passes, as its __init__ fills them one by one (introspect's LayerInfos are built the same way)
_TOP_SETTERS = [TopToken.__dict__[f.name].__set__ for f in fields(TopToken)]
_ABOVE_NEG_INF, _ABOVE_FLOOR = (-math.inf).__lt__, (-1e30).__lt__


def _fast_row(
    logits: list[float], logprobs: list[float], ids: list[int], piece, pieces=None
) -> tuple[TopToken, ...] | None:
    """A row whose every log-probability is finite with a probability above 0 and whose every logit is above the
    floor (every row of a sane model): its TopTokens, the same as `_checked_row` makes; else None."""
    if not (all(map(_ABOVE_NEG_INF, logprobs)) and all(map(_ABOVE_FLOOR, logits))):
        return None  # a -inf, a NaN or a masked logit: the loop says what each one is
    probs = list(map(math.exp, logprobs))
    if not all(probs):  # a probability that underflows to 0: the loop drops it
        return None
    made = list(map(object.__new__, repeat(TopToken, len(ids))))
    texts = pieces(ids) if pieces else map(piece, ids)
    columns = (ids, texts, logits, probs, range(1, len(ids) + 1))  # setter(token, value) for every field, in C:
    deque(chain.from_iterable(map(map, _TOP_SETTERS, repeat(made), columns)), maxlen=0)
    return tuple(made)


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

"""Verify: the session's last cached logits against one no-cache forward over the chat's tokens.

`SessionVerify` is a mixin of `ChatSession` (session.py): the session's own method, kept apart from the chat
loop. It reads the cache and calls the model on a fresh cache of its own; it never writes kvtui's cache.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..reading.verify import (
    compression_cost,
    cost_note,
    judge_recompute,
    mismatch_alarm,
    quantized_errors,
    recompute_last_logits,
)
from ..records.snapshot import VerifyResult
from .forward_speed import forward_threads
from .session_types import SessionConfig, SessionError

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from ..reading.introspect.held import Held
    from ..records.snapshot import BufferToken
    from .press import SessionPress


class SessionVerify:
    """`verify`; `ChatSession` sets the state below."""

    model: Any
    config: SessionConfig
    cache: Any
    dtype: str
    steps: int
    compression_costs: list[tuple[float, bool]]
    _tokens: list[BufferToken]
    _primed: int
    _logits: torch.Tensor | None
    _held: Held | None
    _press: SessionPress | None
    _accepts_logits_to_keep: bool
    _clock: Callable[[], float]
    _record: Callable[..., None]
    _emit: Callable[[str, object], None]

    def _quant_bits(self) -> int:
        return 4 if self.config.cache_backend == "fp8" else self.config.cache_bits  # e4m3: 3 mantissa bits + sign

    def verify(self) -> VerifyResult:
        """Compare the cached last logits with one no-cache forward over the chat's tokens.

        The reference is what the cache should hold: every token of the chat, at positions 0..n-1,
        and no primed pads (they are not part of the conversation, which is the point of that alarm)."""
        chat = self._tokens[self._primed :]
        if self._logits is None or not chat:
            raise SessionError("nothing to verify: send a message first")
        threads = forward_threads(len(chat), self.config.decode_threads)
        quantized = self.config.cache == "quantized"
        # a quantized cache: the recompute keeps its full-precision K/V, to say each layer's quantization error
        reference: list | None = [] if quantized and not self._primed else None  # gets the recompute's own cache
        fresh, ms = recompute_last_logits(
            self.model, [t.id for t in chat], self._accepts_logits_to_keep, threads, self._clock, reference
        )
        result = judge_recompute(
            self._logits,
            fresh,
            self.dtype,
            self.config.top_k_shown,
            len(chat),
            ms,
            self._quant_bits() if quantized else None,
        )
        if reference and reference[0] is not None:
            result = replace(result, layer_errors=quantized_errors(self.cache, reference[0]))
        if self._held is not None:  # lossy by design: the cost of what the press dropped, not a mismatch
            kl, top1 = compression_cost(self._logits, fresh)
            result = replace(result, ok=True, compressed_kl=kl, compressed_top1=top1)
            self.compression_costs.append((kl, top1))
            held = max((len(layer[0]) for layer in self._held.slots), default=0) + self._held.appended
            who = f"the cache (--press {self._press.spec.text if self._press else '?'})"
            self._record([cost_note(self.compression_costs, who, held, len(chat), self.steps)])
        elif not result.ok:
            primed = f" (the cache also holds {self._primed} primed pad tokens)" if self._primed else ""
            bound = " (quantized cache bound)" if quantized else ""
            self._record([mismatch_alarm(result, "cached logits", self.steps, bound, primed)])
        self._emit("verify", result)
        return result

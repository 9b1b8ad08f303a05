"""Rewind, force, reset and restore: the chat session's edits of its history, and its cache rebuilt or
repaired to match (crop when every layer still holds the tokens, else recompute from the token buffer).

`CacheEdits` is a mixin of `ChatSession` (session.py): these are the session's own methods, kept apart from
the chat loop, so the session is still the ONE place that calls the model with kvtui's cache (with turns.py and
step_snapshot.py, its other mixins, which leave the cache to this file and session.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..reading import introspect
from ..reading.introspect.held import Held
from ..records.snapshot import BufferToken, Diagnostic, StepSnapshot, TopToken
from .forward_speed import forward_threads
from .sampling import Sampler
from .session_types import Message, SessionConfig, SessionError


class CacheEdits:
    """The session's history edits; `ChatSession` sets the state below and defines the steps they use."""

    model: Any
    config: SessionConfig
    cache: Any  # a transformers Cache, or None for --cache none
    sampler: Sampler
    steps: int
    pending: TopToken | None
    pending_forced: bool
    _tokens: list[BufferToken]
    _primed: int
    _next_position: int
    _messages: list[Message]
    _turn: int
    _turn_open: bool
    _turn_recorded: bool
    _new_in_turn: int
    _logits: torch.Tensor | None
    _held: Held | None  # a compressed cache's held positions (--press)
    _press: Any  # chat/press.py SessionPress, or None

    if TYPE_CHECKING:  # the chat loop's steps (session.py)

        def _forward(
            self, fed: list[BufferToken], phase: str, found: list[Diagnostic] | None = None
        ) -> StepSnapshot: ...
        def _clear(self) -> None: ...
        def _emit(self, kind: str, payload) -> None: ...
        def _record(self, found, in_step: bool = False) -> None: ...
        def _cached_forward_kwargs(self, tokens: list[BufferToken], cache_len: int) -> dict: ...
        def _history(self) -> torch.Tensor: ...
        def _make_pending(self, scores: torch.Tensor, token_id: int, top: tuple[TopToken, ...] = ()) -> TopToken: ...

    # ---- force -----------------------------------------------------------------------------------

    def force(self, token_id: int) -> TopToken:
        """Replace the pending choice; the next `step` feeds it (origin 'forced')."""
        if self._logits is None:
            raise SessionError("nothing to force: send a message first")
        vocab = self._logits.shape[-1]
        if not 0 <= token_id < vocab:
            raise SessionError(f"token id {token_id} is outside the vocabulary (0..{vocab - 1})")
        scores = self.sampler.process(self._history(), self._logits)
        self.pending = self._make_pending(scores, token_id)
        self.pending_forced = True
        self._turn_open = True
        self._turn_recorded = False
        self._emit("force", {"id": token_id, "text": self.pending.text, "rank": self.pending.rank})
        return self.pending

    # ---- rewind, reset ---------------------------------------------------------------------------

    def rewind(self, n: int = 1) -> StepSnapshot | None:
        """Remove the last n cached tokens (cache and buffer together) and re-choose the next token."""
        chat_len = len(self._tokens) - self._primed
        if n < 1:
            raise SessionError(f"rewind needs n >= 1, got {n}")
        if n > chat_len:
            raise SessionError(f"cannot rewind {n} tokens: the cache holds {chat_len}")
        return self.rewind_to(self._primed + chat_len - n)

    def rewind_to(self, length: int) -> StepSnapshot | None:
        """Keep the first `length` buffer tokens. The last kept one is re-fed so the logits are fresh."""
        if not self._primed <= length <= len(self._tokens):
            raise SessionError(f"cannot rewind to {length}: the buffer holds {len(self._tokens)} tokens")
        self._emit("rewind", {"to_length": length, "from_length": len(self._tokens)})
        self._turn_recorded = False
        if length == self._primed:
            self._truncate(length)
            self.pending, self._logits = None, None
            self._messages = [m for m in self._messages if m.role == "system"]
            self._turn_open = False
            self._turn = 0
            return None
        last = self._tokens[length - 1]
        self._turn = last.turn  # the turn the cut lies in: the tokens fed next belong to it, the next send follows it
        refeed = [last]
        if self._held is not None and length - 1 < self._held.logical:
            # the cut lies inside the prefill a press compressed: the dropped tokens are gone, so the kept context is
            # prefilled again from an empty cache under the press (what a fresh chat of these tokens holds)
            refeed = self._tokens[self._primed : length]
            self._note_rewind(
                "cache-edited",
                f"rewind to {length}: inside the {self._held.logical}-token prefill --press compressed; "
                f"prefilling those {len(refeed)} tokens again under the press",
            )
            self._truncate(self._primed)
        else:
            self._truncate(length - 1)
        kept = [m for m in self._messages if m.start < length]
        if not kept or kept[-1].role != "assistant":
            kept.append(Message("assistant", "", length))  # generation continues from the cut
        self._messages = kept
        self._turn_open = True
        self._new_in_turn = len(self._tokens) + len(refeed) - kept[-1].start
        return self._forward(refeed, "rewind")

    def reset(self) -> None:
        """Empty the cache and the chat (the system prompt stays)."""
        self._new_cache()
        self._clear()
        self._emit("reset", {})

    def _truncate(self, length: int) -> None:
        """Cut cache and buffer to `length` tokens: crop when every layer still holds them, else recompute."""
        if length >= len(self._tokens):
            return
        kept = self._tokens[:length]  # a new list: views handed out earlier stay valid
        blocker = "none" if self.cache is None else introspect.truncate_blocker(self.cache, length)
        if self._held is not None:  # a compressed cache: its slots are not the buffer's positions
            self._cut_compressed(length)
            self._tokens = kept
        elif blocker == "none":  # --cache none: the context is the token list, nothing else to cut
            self._tokens = kept
        elif blocker is None:
            recorded = introspect.records_past(self.cache)
            introspect.truncate(self.cache, length)
            self._tokens = kept
            if recorded:
                self._note_rewind(
                    "state-rewind", f"rewind to {length}: conv states cropped exactly with transformers' past recording"
                )
        elif blocker == "sliding":
            self._note_rewind(
                "sliding-eviction",
                f"rewind to {length} needs states that sliding layers evicted: recomputing {length} tokens",
            )
            self._recompute(kept)
        else:
            why = (
                "conv/recurrent (SSM, linear-attention) states summarize every token and cannot be cropped"
                if blocker == "state"
                else "quantized K/V cannot be cut per token"
            )
            self._note_rewind(
                "state-rewind", f"rewind to {length}: {why}; recomputed {length} tokens from the token buffer"
            )
            self._recompute(kept)
        self._next_position = kept[-1].position + 1 if kept else 0
        self.pending = None

    def _cut_compressed(self, length: int) -> None:
        """Cut a compressed cache to the first `length` buffer tokens: every layer drops the same newest slots (the
        tokens fed after the press's prefill, which every layer appended), or the cache empties. Refused (nothing
        changed) inside the compressed prefill: what the press dropped cannot be cut back to."""
        held = self._held
        assert held is not None and self.cache is not None
        if length <= self._primed:
            self._new_cache()
            return
        if length < held.logical:
            raise SessionError(
                f"cannot cut the cache to {length} tokens: the first {held.logical} were compressed by --press "
                f"({held.cause}), so no slot ends there; rewind to {held.logical} or later, or to 0"
            )
        remove = held.fed_total - length
        if remove <= 0:
            return
        with torch.inference_mode():
            for layer in self.cache.layers:
                layer.crop(-remove)  # negative: remove n slots, the newest (4.5x and 5.x alike)
        held.appended -= remove

    def _note_rewind(self, code: str, message: str) -> None:
        """How a rewind cut the cache (an info alarm of its own, outside a forward)."""
        self._record([Diagnostic(code, "info", message, self.steps)])

    # ---- the cache rebuilt ------------------------------------------------------------------------

    def _new_cache(self) -> None:
        # A fresh object rather than cache.reset(): 4.x resets dynamic layers by zeroing, then appends after the zeros.
        self._held = None
        if self.config.cache == "none":
            self.cache = None
            return
        try:
            self.cache = introspect.make_cache(
                self.config.cache,
                self.model.config,
                self.config.max_cache_len,
                bits=self.config.cache_bits,
                backend=self.config.cache_backend,
            )
        except ValueError as exc:
            raise SessionError(str(exc)) from None
        introspect.activate_past_recording(self.cache)  # conv-only layers (LFM2): rewinds crop exactly

    def _recompute(self, tokens: list[BufferToken]) -> None:
        self._new_cache()
        self._tokens = list(tokens)
        if not tokens or self.cache is None:
            return
        with torch.inference_mode(), forward_threads(len(tokens), self.config.decode_threads):
            self.model(**self._cached_forward_kwargs(tokens, 0))

    def _restore(self, length: int, lengths: list[int] | None = None) -> None:
        """After a failed forward, bring the cache back to `length` tokens (some layers may have been written);
        a compressed cache's layers each to their own `lengths` (a press gives layers different lengths)."""
        if self.cache is None:  # --cache none: a failed forward changed nothing
            return
        if length == 0 and self._press is not None:  # a press's prefill failed (maybe halfway): start it over
            self._new_cache()
            return
        if lengths is not None:
            with torch.inference_mode():
                for layer, before in zip(self.cache.layers, lengths):
                    extra = layer.keys.shape[-2] - before
                    if extra > 0:
                        layer.crop(-extra)
            return
        try:
            # a linear layer's state was changed in place by the failed forward: only a recompute undoes it
            if introspect.can_truncate(self.cache, length) and not introspect.has_linear_layers(self.cache):
                introspect.truncate(self.cache, length)
            else:
                self._recompute(self._tokens[:length])
        except Exception:  # noqa: BLE001  the cache is beyond repair: start it over from the buffer
            self._new_cache()
            if self._tokens:
                self._recompute(self._tokens)

    # ---- restore (a restarted engine process) ------------------------------------------------------

    def restorable(self) -> dict:
        """What a fresh session needs besides the token buffer to go on where this one is: plain values."""
        return {
            "messages": [{"role": m.role, "content": m.content, "start": m.start} for m in self._messages],
            "turn": self._turn,
            "steps": self.steps,
            "press_at": self._held.logical if self._held is not None else None,  # the tokens the press's prefill took
        }

    def restore(self, tokens: list[BufferToken], state: dict) -> StepSnapshot | None:
        """Rebuild the cache from a token buffer in one forward (phase "restore"): the chat goes on from there.

        `state` is what `restorable()` returned, possibly some steps before the tokens end: the open
        assistant message takes every token after its start, as a live one does."""
        self._clear()
        self._new_cache()
        self._messages = [Message(m["role"], m["content"], m["start"]) for m in state.get("messages", [])]
        self._turn = state.get("turn", 0)
        self.steps = state.get("steps", self.steps)
        if not tokens:
            return None
        self._primed = next((i for i, t in enumerate(tokens) if t.origin != "primed"), len(tokens))
        last = self._messages[-1] if self._messages else None
        self._turn_open = last is not None and last.role == "assistant"
        self._turn_recorded = False
        self._new_in_turn = len(tokens) - last.start if last is not None and self._turn_open else 0
        press_at = state.get("press_at")
        if self._press is not None and press_at and press_at < len(tokens):  # the press's prefill, then the rest
            self._forward(list(tokens[:press_at]), "restore")
            return self._forward(list(tokens[press_at:]), "restore")
        return self._forward(list(tokens), "restore")

"""After each forward of the chat session: the next token chosen from its logits (pending until the next
step feeds it), the newest query's attention, the checks on the cache's shapes and counters, and the frozen
`StepSnapshot` sent to the recorder and the listeners. Built from shapes and counters, never from K/V copies.

`StepSnapshots` is a mixin of `ChatSession` (session.py), as `CacheEdits` (edits.py) is: the session's own
methods, kept apart from the forward. They read the cache; they never write it or move the cursor.

Shapes: logits and scores [vocab] float (the last position's); history ids [1, n].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..reading import introspect
from ..reading.alarms import Alarms
from ..reading.attention import AttentionCapture, AttentionStep
from ..reading.diagnostics import SpecialIds, check_attention
from ..reading.introspect.held import Held, held_infos
from ..reading.token_texts import TokenTexts
from ..reading.topk import chosen_from_top, top_tokens, watched_tokens
from ..records.listeners import Listeners
from ..records.snapshot import BufferToken, LayerInfo, StepSnapshot, TokenBuffer, TopToken
from .sampling import Sampler
from .session_types import SessionConfig


class StepSnapshots:
    """What a forward yields; `ChatSession` sets the state below and defines the steps they use."""

    config: SessionConfig
    cache: Any  # a transformers Cache, or None for --cache none
    capacity: int | None  # a static cache's slots
    device: torch.device
    sampler: Sampler
    steps: int
    last: StepSnapshot | None
    pending: TopToken | None
    pending_forced: bool
    special: SpecialIds
    watch_ids: tuple[int, ...]
    attention_layer: int
    _tokens: list[BufferToken]
    _turn: int
    _next_position: int
    _no_history: torch.Tensor  # [1, 0]
    _window: int | None
    _alarms: Alarms
    _held: Held | None  # a compressed cache's held positions (--press), else None
    _attention: AttentionCapture | None
    _attention_memory: dict
    _texts: TokenTexts
    _clock: Callable[[], float]
    _on_snapshot: Listeners[[StepSnapshot]]

    if TYPE_CHECKING:  # the session's own (session.py, turns)

        @property
        def buffer(self) -> TokenBuffer: ...
        @property
        def cache_length(self) -> int: ...
        @property
        def recompiles(self) -> int: ...
        def piece(self, token_id: int) -> str: ...
        def _emit(self, kind: str, payload) -> None: ...
        def _record(self, found, in_step: bool = False) -> None: ...
        def _turn_done_after(self) -> bool: ...
        def record_turn_end(self) -> None: ...

    # ---- the next token --------------------------------------------------------------------------

    def _choose_next(self, logits: torch.Tensor) -> tuple[torch.Tensor, tuple[TopToken, ...], tuple[TopToken, ...]]:
        """Choose the pending token from a forward's logits [vocab]: the processed scores [vocab] and the top
        tokens before and after the sampler's processors."""
        scores = self.sampler.process(self._history(), logits)
        k = self.config.top_k_shown
        top = top_tokens(scores, k, self.piece)
        top_raw = top if scores is logits else top_tokens(logits, k, self.piece)  # no processors: the same
        self.pending = self._make_pending(scores, self.sampler.choose(scores, top), top)
        self.pending_forced = False
        return scores, top_raw, top

    def _history(self) -> torch.Tensor:
        """The ids the sampler's processors read: [1, n], or the empty [1, 0] when none reads them."""
        if not self.sampler.needs_history:
            return self._no_history
        return torch.tensor([[t.id for t in self._tokens]], device=self.device)  # [1, n]: O(cache), opt-in

    def _make_pending(self, scores: torch.Tensor, token_id: int, top: tuple[TopToken, ...] = ()) -> TopToken:
        """`token_id` as the pending choice, with its probability and rank under `scores` [vocab]."""
        known = chosen_from_top(top, token_id)  # a greedy or likely choice: no vocab-sized work
        if known is not None:
            return known
        probs = torch.softmax(scores, dim=-1)  # [vocab]
        prob = probs[token_id]  # 0-dim
        return TopToken(
            id=token_id,
            text=self.piece(token_id),
            logit=float(scores[token_id]),
            prob=float(prob),
            rank=int((probs > prob).sum()) + 1,
        )

    # ---- attention ----------------------------------------------------------------------------------

    def _newest_attention(self) -> AttentionStep | None:
        """Every layer's attention of the newest query, over the buffer's positions (one transfer)."""
        capture = self._attention
        assert capture is not None
        layer = self.attention_layer
        capture.head_layer = layer % capture.num_layers if capture.num_layers and layer < 0 else layer
        return capture.take(self.buffer, self._turn, self.special.pad, self.special.pad_is_distinct)

    def close_attention(self) -> None:
        """Give transformers' attention functions back (the session's model is no longer captured)."""
        if self._attention is not None:
            self._attention.detach()

    # ---- the snapshot -------------------------------------------------------------------------------

    def _snapshot(
        self, phase, fed, scores, found, forward_ms, snap_started, attention, compile_ms, top_raw, top
    ) -> StepSnapshot:
        """The step's checks on the cache's counters and the attention, recorded; its frozen snapshot, sent to the
        recorder ("step") and the listeners. `scores` [vocab]: the processed logits the watched tokens are read in."""
        layers: tuple[LayerInfo, ...]
        if self.cache is None:  # --cache none: nothing is cached, there are no layers to read or check
            layers, cache_len = (), 0
        else:
            layers = introspect.layer_infos(self.cache, self._window)
            cache_len = self.cache_length
            held = self._held
            if held is not None:  # a compressed cache: which positions each layer holds, and the count fed
                layers = held_infos(layers, held)
            found += self._alarms.check_cursor(
                self.steps, self._next_position, held.fed_total if held is not None else cache_len
            )
            found += self._alarms.check_layers(self.steps, layers, self.capacity, cache_len, reserve=1)
        if attention is not None:
            detail = attention.detail
            found += check_attention(
                self.steps,
                attention.pads,
                detail.regions,
                detail.shares,
                self._attention_memory,
                "",
                len(self._tokens) - 1,
            )
        self._record(found, in_step=True)
        snapshot = StepSnapshot(
            step=self.steps,
            phase=phase,
            turn=self._turn,
            input_ids=tuple(t.id for t in fed),
            positions=tuple(t.position for t in fed),
            cursor=self._next_position,
            cache_seq_length=cache_len,
            capacity=self.capacity,
            layers=layers,
            topk=top_raw,
            topk_processed=top,
            watched=watched_tokens(scores, self.watch_ids, self.piece),
            chosen=self.pending,
            chosen_forced=self.pending_forced,
            diagnostics=tuple(found),
            forward_ms=forward_ms,
            snapshot_ms=(self._clock() - snap_started) * 1000,
            buffer=self.buffer,
            turn_done=self._turn_done_after(),
            attention=attention.layers if attention else None,
            attention_layer=attention.detail.layer if attention else None,
            attention_detail=attention.detail if attention else None,
            attention_off=self._attention.off_reason() if self._attention is not None and not attention else None,
            compiled=self.config.compile,
            compile_ms=compile_ms,
            recompiles=self.recompiles,
            uncached=self.cache is None,
            token_bytes=self._texts.token_bytes,
        )
        self.last = snapshot
        self._emit("step", snapshot)
        self._on_snapshot(snapshot)
        if snapshot.turn_done:
            self.record_turn_end()
        return snapshot

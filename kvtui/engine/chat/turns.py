"""A conversation's turns: a user's message (chat) or prompt text (completion) rendered into tokens, of which
only what the cache lacks is prefilled; the transcript (`messages`); and when a turn ends (a stop token or
--max-new-tokens).

`ChatTurns` is a mixin of `ChatSession` (session.py), as `CacheEdits` (edits.py) is: the session's own methods.
They decide what to feed; the session's forward feeds it, and edits.py cuts the cache back to the prefix the
re-rendered chat shares with it, so this module never touches the cache or the cursor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..reading.introspect.held import Held
from ..records.snapshot import BufferToken, Diagnostic, StepSnapshot, TopToken
from ..records.token_bytes import run_text
from .render import render_chat, rendered_prefix, tokenize
from .session_types import CacheOverflowError, Message, PressError, SessionConfig


class ChatTurns:
    """Send and the turn's bookkeeping; `ChatSession` sets the state below and defines the steps they use."""

    config: SessionConfig
    tokenizer: Any
    steps: int
    stop_ids: frozenset[int]  # ids that end a reply (render.special_ids)
    pending: TopToken | None
    _tokens: list[BufferToken]
    _primed: int
    _messages: list[Message]
    _turn: int
    _turn_open: bool
    _turn_recorded: bool
    _new_in_turn: int
    _held: Held | None  # a compressed cache's held positions (--press)

    if TYPE_CHECKING:  # the session's own (session.py, edits.py)

        def piece(self, token_id: int) -> str: ...
        @property
        def token_bytes(self) -> dict[int, bytes]: ...
        def _emit(self, kind: str, payload) -> None: ...
        def _prime(self) -> None: ...
        def _truncate(self, length: int) -> None: ...
        def _buffer_token(self, token_id: int, origin: str, position: int, turn: int) -> BufferToken: ...
        def _forward(
            self, fed: list[BufferToken], phase: str, found: list[Diagnostic] | None = None
        ) -> StepSnapshot: ...

    # ---- the transcript ----------------------------------------------------------------------------

    @property
    def turn(self) -> int:
        return self._turn

    @property
    def turn_open(self) -> bool:
        return self._turn_open

    @property
    def turn_done(self) -> bool:
        return self.pending is None or self._turn_done_after()

    @property
    def messages(self) -> list[dict]:
        out = [{"role": m.role, "content": m.content} for m in self._messages]
        if out and out[-1]["role"] == "assistant" and self._turn_open:
            text = self._reply_text()
            if "\ufffd" in text:  # the reply so far ends inside a character (or holds bytes that make none)
                # SentencePiece's byte fallback makes a whole byte run U+FFFD, its whole characters too; from the
                # tokens' bytes only what makes no character is, as a replay rebuilds it (records/replay.transcript)
                reply = self._tokens[self._messages[-1].start :]
                text = run_text(((t.id, t.piece) for t in reply if not t.special), self.token_bytes)
            out[-1]["content"] = text
        return out

    def _stops(self, token_id: int) -> bool:
        return token_id in self.stop_ids

    def _reply_text(self) -> str:
        start = self._messages[-1].start
        return self.tokenizer.decode([t.id for t in self._tokens[start:]], skip_special_tokens=True)

    # ---- a turn begins: send ------------------------------------------------------------------------

    def send(self, text: str) -> StepSnapshot:
        """Add a user message (chat) or prompt text (completion) and prefill what the cache lacks."""
        if self.config.prime_pad and not self._tokens:
            self._prime()
        if self.config.mode == "completion":
            return self._send_completion(text)
        self._close_turn()
        messages = self.messages + [{"role": "user", "content": text}]
        rendered = render_chat(self.tokenizer, messages, self.config.chat_tokenize)
        common, drift = rendered_prefix(self._tokens[self._primed :], rendered, self.piece, self.steps + 1)
        if common == len(rendered):  # nothing new: re-feed the last token to get fresh logits
            common -= 1
        held = self._held
        if held is not None and self._primed + common < held.logical:
            common = 0  # the re-rendered chat differs inside the prefill a press compressed: prefill it all again
        self._turn += 1
        self._truncate(self._primed + common)
        fed = [
            self._buffer_token(token_id, origin, i, self._turn)
            for i, (token_id, origin) in enumerate(rendered[common:], start=common)
        ]
        # the user message starts at its first own token; the header before it ends the previous message
        user_start = next(
            (self._primed + i for i in range(common, len(rendered)) if rendered[i][1] == "user"), self._primed + common
        )
        snapshot = self._refusable_prefill(fed, drift)
        self._messages.append(Message("user", text, user_start))
        self._messages.append(Message("assistant", "", len(self._tokens)))
        return snapshot

    def _send_completion(self, text: str) -> StepSnapshot:
        self._close_turn()
        self._turn += 1
        first = not self._tokens[self._primed :]
        rendered = tokenize(self.tokenizer, text, add_special=first)
        base = len(self._tokens) - self._primed
        fed = [
            self._buffer_token(token_id, origin, base + i, self._turn) for i, (token_id, origin) in enumerate(rendered)
        ]
        snapshot = self._refusable_prefill(fed, [])
        self._messages.append(Message("assistant", "", len(self._tokens)))
        return snapshot

    def _refusable_prefill(self, fed: list[BufferToken], extra: list[Diagnostic]) -> StepSnapshot:
        """A send's prefill; refused before any forward (a full static cache), the turn it counted did not begin."""
        try:
            return self._prefill(fed, extra)
        except (CacheOverflowError, PressError):
            self._turn -= 1
            raise

    def _prefill(self, fed: list[BufferToken], extra: list[Diagnostic]) -> StepSnapshot:
        self._new_in_turn = 0
        self._turn_open = True
        self._turn_recorded = False
        return self._forward(fed, "prefill", extra)

    # ---- a turn ends ------------------------------------------------------------------------------

    def _close_turn(self) -> None:
        self._close_turn_text()
        self.record_turn_end()  # a turn cut short (a refusal, a pause) still gets its buffer line
        self._turn_open = False
        self.pending = None

    def record_turn_end(self) -> None:
        """Tell the recorder the turn is over (once per turn): it writes the buffer line."""
        if self._turn_open and not self._turn_recorded:
            self._turn_recorded = True
            self._emit("turn-end", None)

    def _turn_done_after(self) -> bool:
        return self.pending is not None and (
            self._stops(self.pending.id) or self._new_in_turn >= self.config.max_new_tokens
        )

    def _close_turn_text(self) -> None:
        if self._messages and self._messages[-1].role == "assistant":
            self._messages[-1].content = self._reply_text()

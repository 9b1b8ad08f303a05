"""The chat session (send, step, generate, verify): the ONE place that calls the model with kvtui's cache.

Its methods are spread over mixins of `ChatSession`, the same session's methods: turns.py (send renders the
chat and prefills only what the cache lacks; the transcript; when a turn ends), step_snapshot.py (after each
forward: the next token chosen, the step's checks, its frozen `StepSnapshot`), edits.py (rewind, force, reset,
restore), verifying.py (the cache's last logits against a recompute). This file and edits.py are the only code
that feeds past_key_values, writes the cache and moves the cursor; forward_speed.py only wraps the forward
(torch.compile, threads); render.py turns a chat into tokens.

The decode loop is small typed steps (gpt-fast style): `send` prefills, `step` feeds the pending token and
samples the next, `generate` repeats `step`. Every forward yields a frozen `StepSnapshot` built from shapes and
counters, never from K/V copies. `on_snapshot` and `on_event` take several subscribers
(`session.on_snapshot.add(fn)`).

Shapes: input_ids / position_ids [1, n]; logits [1, 1, vocab] (logits_to_keep=1);
cache K/V per layer [batch=1, kv_heads, slots, head_dim].
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace

import torch

from ..reading import introspect
from ..reading.alarms import Alarms
from ..reading.attention import AttentionCapture
from ..reading.diagnostics import check_feed
from ..reading.introspect.held import Held
from ..reading.token_texts import tokenizer_texts
from ..reading.tokens import special_token_ids
from ..records.listeners import Listeners
from ..records.snapshot import BufferToken, Diagnostic, StepSnapshot, TokenBuffer, TopToken
from .edits import CacheEdits
from .forward_speed import CompiledDecode, forward_threads, graph_count
from .press import SessionPress
from .render import special_ids
from .sampling import Sampler, SamplerSettings
from .session_types import CacheOverflowError, Message, PressError, SessionConfig, SessionError
from .step_snapshot import StepSnapshots
from .turns import ChatTurns
from .verifying import SessionVerify

__all__ = ["CacheOverflowError", "ChatSession", "SessionConfig", "SessionError"]


class ChatSession(ChatTurns, StepSnapshots, CacheEdits, SessionVerify):
    def __init__(
        self,
        model,
        tokenizer,
        config: SessionConfig | None = None,
        on_snapshot: Callable[[StepSnapshot], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.model, self.tokenizer = model, tokenizer
        self._clock = clock  # injectable so screenshot tests get stable timings
        self.config = config or SessionConfig()
        if self.config.mode not in ("chat", "completion"):
            raise SessionError(f"unknown mode {self.config.mode!r}: use chat or completion")
        if self.config.chat_tokenize not in ("template", "text"):
            raise SessionError(f"unknown chat tokenization {self.config.chat_tokenize!r}: use template or text")
        if self.config.mode == "chat" and not getattr(tokenizer, "chat_template", None):
            raise SessionError("this tokenizer has no chat template: use completion mode (--mode completion)")
        self._on_snapshot: Listeners[[StepSnapshot]] = Listeners()
        if on_snapshot is not None:
            self._on_snapshot.add(on_snapshot)
        self._on_event: Listeners[[str, object]] = Listeners()
        self.device = model.get_input_embeddings().weight.device
        self._no_history = torch.empty((1, 0), dtype=torch.long, device=self.device)  # [1, 0], read-only
        self.dtype = str(model.dtype).removeprefix("torch.")
        self.sampler = Sampler(self.config.sampler, self.device)
        self._special_set = special_token_ids(tokenizer)
        self.special = special_ids(model, tokenizer, self._special_set, chat=self.config.mode == "chat")
        self.stop_ids = self.special.eos
        self._texts = tokenizer_texts(tokenizer)  # the one token-text cache (reading/token_texts.py)
        # Read once per forward; plain attribute swaps, so the UI may set them from its thread.
        self.watch_ids: tuple[int, ...] = tuple(self.config.watch)
        self.attention_layer: int = -1  # which layer's per-head attention to keep (-1 = the last with attention)
        # --attention: every layer's newest-query attention, captured around the model's own attention function
        self._attention = AttentionCapture(model) if self.config.attention else None
        self._attention_memory: dict = {}  # what the attention alarms last said (check_attention)
        self._window = introspect.config_window(model.config)
        self._accepts_cache_position = introspect.forward_accepts(model, "cache_position")
        self._accepts_logits_to_keep = introspect.forward_accepts(model, "logits_to_keep")
        self._cache_argument = introspect.cache_argument(model)  # 'cache' from transformers 5.24
        if self.config.cache == "offloaded" and self.device.type != "cuda":
            raise SessionError(
                f"--cache offloaded needs the model on a CUDA device (transformers' offloading moves "
                f"layers with CUDA streams); this model is on {self.device.type}"
            )
        if self.config.compile and self.config.cache != "static":
            raise SessionError(
                "--compile needs --cache static: a dynamic cache changes shape every step, "
                "so a compiled forward would recompile every step"
            )
        refusal = introspect.hybrid_refusal(model.config)  # a feature test of this transformers' DynamicCache
        if refusal:
            raise SessionError(refusal)
        self._press = self._make_press() if self.config.press else None
        self._held: Held | None = None  # what a compressed cache holds (set by the press's prefill, chat/press.py)
        self.compression_costs: list[tuple[float, bool]] = []  # verifies of a compressed cache: (KL, top-1 agrees)
        self._new_cache()
        self.capacity = introspect.static_capacity(self.cache) if self.cache is not None else None
        self._compiled = CompiledDecode(model, self.device)  # --compile: one-token decode steps, built on first use
        self.diagnostics: list[Diagnostic] = []
        self.last: StepSnapshot | None = None
        self.steps = 0
        self._clear()

    def _make_press(self) -> SessionPress:
        """--press: refused where the press and kvtui's reading of it cannot both be right (one line each)."""
        spec = self.config.press
        assert spec is not None
        why = None
        if self.config.cache != "dynamic":
            why = f"--cache {self.config.cache}: a press shortens dynamic layers only (use --cache dynamic)"
        elif self._window is not None:
            why = "this model has sliding-window layers, which kvpress does not compress alike (full attention only)"
        elif self.config.attention:
            why = "--attention maps key slots to buffer positions one to one, which a compressed cache breaks"
        elif self.config.prime_pad:
            why = "--prime-pad's pad pass would be the prefill the press compresses"
        if why:
            raise SessionError(f"--press {spec} cannot run here: {why}")
        return SessionPress(spec, self.model)

    @property
    def press(self) -> str | None:
        """The press's spec and class (`knorm:0.5 KnormPress(compression_ratio=0.5)`), or None."""
        return f"{self._press.spec.text} {self._press.spec.describe()}" if self._press is not None else None

    @property
    def held(self) -> Held | None:
        """A compressed cache's held positions (per layer, per KV head), or None while it holds what was fed."""
        return self._held

    # ---- state ---------------------------------------------------------------------------------

    def _clear(self) -> None:
        self._tokens: list[BufferToken] = []  # append-only; a rewind starts a new list (see TokenBuffer)
        self._primed = 0  # pad tokens at the front from --prime-pad, outside the chat's own positions
        self._next_position = 0  # the cursor: next position id the session writes
        self._messages: list[Message] = []
        if self.config.system and self.config.mode == "chat":
            self._messages.append(Message("system", self.config.system, 0))
        self._turn = 0
        self._turn_open = False
        self._turn_recorded = False  # the recorder got this turn's "turn-end"
        self._new_in_turn = 0
        self.pending: TopToken | None = None  # next token, chosen but not fed yet
        self.pending_forced = False
        self._logits: torch.Tensor | None = None  # [vocab] float, raw logits of the last forward
        self._alarms = Alarms()

    @property
    def on_snapshot(self) -> Listeners[[StepSnapshot]]:
        """After every forward, in the order added (the engine process, the headless runner, a benchmark's stamp)."""
        return self._on_snapshot

    @property
    def on_event(self) -> Listeners[[str, object]]:
        """Every step, alarm outside a forward, verify, turn end and edit, as (kind, payload): the recorder's."""
        return self._on_event

    @property
    def buffer(self) -> TokenBuffer:
        return TokenBuffer(self._tokens)

    @property
    def last_logits(self) -> torch.Tensor | None:
        """Raw logits [vocab] of the last forward (for verify and tests; the UI never sees tensors)."""
        return self._logits

    @property
    def cursor(self) -> int:
        return self._next_position

    @property
    def uncached(self) -> bool:
        """--cache none: no cache object; every forward re-reads the whole context."""
        return self.cache is None

    @property
    def cache_length(self) -> int:
        return 0 if self.cache is None else introspect.seq_length(self.cache)

    def piece(self, token_id: int) -> str:
        return self._texts.piece(token_id)

    @property
    def token_bytes(self) -> dict[int, bytes]:
        """id -> bytes of the tokens whose decoded piece is not their bytes (records/token_bytes.py)."""
        return self._texts.token_bytes

    # ---- the forward -----------------------------------------------------------------------------

    def _forward(self, fed: list[BufferToken], phase: str, found: list[Diagnostic] | None = None) -> StepSnapshot:
        """Feed tokens through the model with their own position ids, then choose the next token."""
        if not fed:
            raise SessionError("nothing to feed")
        cache_len = self.cache_length
        if self.capacity is not None and cache_len + len(fed) > self.capacity:
            error = CacheOverflowError(self.capacity, cache_len, len(fed))
            self._record([Diagnostic("static-capacity", "error", str(error), self.steps + 1)])
            raise error
        step = self.steps + 1
        if self.cache is None:  # --cache none: the tokens the model re-reads take the cache's place in the checks
            cache_len = len(self._tokens)
        found = list(found or []) + check_feed(
            step, fed, self._tokens[-1] if self._tokens else None, self.special, self.piece
        )
        positions = [t.position for t in fed]
        # a compressed cache: the kept keys encode the positions they were fed at, so the next one is the logical count
        expected = self._held.expected_next(cache_len) if self._held is not None else cache_len
        found += self._alarms.check_positions(step, positions, expected)
        press = self._press is not None and self.cache is not None and cache_len == 0 and self._press.prepare(len(fed))
        lengths = [layer.keys.shape[-2] for layer in self.cache.layers] if self._held is not None else None

        kwargs = (
            self._cached_forward_kwargs(fed, cache_len)
            if self.cache is not None
            else self._full_forward_kwargs(self._tokens + fed)
        )
        compiled = self.config.compile and len(fed) == 1 and not self.config.attention
        graphs_before = graph_count() if compiled else 0
        started = self._clock()
        applied = self._press.applied(self.model, self.cache) if press and self._press is not None else nullcontext({})
        try:
            with (
                torch.inference_mode(),
                forward_threads(kwargs["input_ids"].shape[1], self.config.decode_threads),
                applied as written,
            ):
                out = (
                    self._compiled.forward()(**kwargs) if compiled else self.model(**kwargs)
                )  # updates self.cache in place (and the press shortens it, during the prefill of an empty cache)
        except BaseException as exc:
            self._restore(cache_len, lengths)
            if press and isinstance(exc, (AssertionError, ValueError, RuntimeError, IndexError)):
                failed = f"--press {self.config.press} failed on a prefill of {len(fed)} tokens: {exc}"
                raise PressError(failed) from exc
            raise
        if press and self._press is not None:
            self._held, said = self._press.read(written, self.cache, len(self._tokens), len(fed), step)
            found += said
        elif self._held is not None:
            self._held.fed(len(fed))
        logits = out.logits[0, -1].float()  # [vocab]
        forward_ms = (self._clock() - started) * 1000
        compile_ms = self._compiled.compile_ms(graphs_before, forward_ms) if compiled else None

        snap_started = self._clock()
        self.steps = step
        self._tokens.extend(fed)
        self._next_position = positions[-1] + 1
        attention = self._newest_attention() if self._attention is not None else None
        self._logits = logits
        scores, top_raw, top = self._choose_next(logits)
        self._new_in_turn += phase == "decode"
        return self._snapshot(phase, fed, scores, found, forward_ms, snap_started, attention, compile_ms, top_raw, top)

    # --compile: what torch.compile built (headless prints it, the snapshot carries recompiles)
    @property
    def compiles(self) -> int:
        return self._compiled.compiles

    @property
    def compile_ms_total(self) -> float:
        return self._compiled.compile_ms_total

    @property
    def recompiles(self) -> int:
        return self._compiled.recompiles

    def _cached_forward_kwargs(self, tokens: list[BufferToken], cache_len: int) -> dict:
        """Arguments of a forward that writes `tokens` into self.cache after `cache_len` cached ones."""
        kwargs = dict(
            input_ids=torch.tensor([[t.id for t in tokens]], device=self.device),  # [1, n]
            position_ids=torch.tensor([[t.position for t in tokens]], device=self.device),  # [1, n]
            use_cache=True,
            **{self._cache_argument: self.cache},
        )
        if self._accepts_cache_position:  # 4.x: static layers write at cache_position
            kwargs["cache_position"] = torch.arange(cache_len, cache_len + len(tokens), device=self.device)
        if self._accepts_logits_to_keep:  # the prefill needs only the last row of logits
            kwargs["logits_to_keep"] = 1
        return kwargs

    def _full_forward_kwargs(self, tokens: list[BufferToken]) -> dict:
        """--cache none: one forward over every token of the context, no cache object (use_cache=False)."""
        kwargs = dict(
            input_ids=torch.tensor([[t.id for t in tokens]], device=self.device),  # [1, n]
            position_ids=torch.tensor([[t.position for t in tokens]], device=self.device),  # [1, n]
            use_cache=False,
        )
        if self._accepts_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        return kwargs

    def _record(self, found, in_step: bool = False) -> None:
        self.diagnostics.extend(found)
        if found and not in_step:  # raised outside a forward: a record of their own
            self._emit("diagnostics", list(found))

    def _emit(self, kind: str, payload) -> None:
        self._on_event(kind, payload)

    # ---- tokens fed --------------------------------------------------------------------------------

    def _buffer_token(self, token_id: int, origin: str, position: int, turn: int) -> BufferToken:
        return BufferToken(
            position=position,
            id=token_id,
            piece=self.piece(token_id),
            special=token_id in self._special_set,
            origin=origin,
            turn=turn,
        )

    def _prime(self) -> None:
        """The mistake being reproduced: a dummy pass of pad tokens, then the chat starts at position 0."""
        pad = self.special.pad if self.special.pad is not None else (self.special.bos or 0)
        fed = [self._buffer_token(pad, "primed", i, 0) for i in range(self.config.prime_pad)]
        self._forward(fed, "prefill")
        self._primed = len(fed)
        self._next_position = 0  # ...and the cursor is reset as if the cache were empty
        self.pending = None

    # ---- decoding --------------------------------------------------------------------------------

    def step(self) -> StepSnapshot:
        """Feed the pending token (sampled or forced) and choose the next one."""
        if self.pending is None:
            raise SessionError("nothing to step: send a message first")
        if self.turn_done and not self.pending_forced:
            raise SessionError(
                "the turn is over (end token or --max-new-tokens): send a message, rewind or force a token"
            )
        origin = "forced" if self.pending_forced else "assistant"
        token = self._buffer_token(self.pending.id, origin, self._next_position, self._turn)
        return self._forward([token], "decode")

    def generate(
        self, cancel: threading.Event | None = None, on_step: Callable[[StepSnapshot], None] | None = None
    ) -> StepSnapshot | None:
        """Step until the turn ends or `cancel` is set; returns the last snapshot."""
        last = self.last
        while self.pending is not None and not self.turn_done and not (cancel and cancel.is_set()):
            last = self.step()
            if on_step:
                on_step(last)
        if self.turn_done:
            self._close_turn_text()
        return last

    def set_sampler(self, settings: SamplerSettings) -> None:
        self.sampler = Sampler(settings, self.device)
        self.config = replace(self.config, sampler=settings)
        self._emit(
            "sampler",
            {
                "temperature": settings.temperature,
                "top_k": settings.top_k,
                "top_p": settings.top_p,
                "repetition_penalty": settings.repetition_penalty,
                "seed": settings.seed,
            },
        )

    def watch_token(self, token_id: int) -> None:
        """Follow a token's probability and rank from the next step (a tuple swap: safe from the UI thread)."""
        if token_id not in self.watch_ids:
            self.watch_ids = self.watch_ids + (token_id,)
            self._emit("watch", {"id": token_id, "text": self.piece(token_id)})

    def note_export(self, path) -> None:
        self._emit("export", {"path": str(path)})

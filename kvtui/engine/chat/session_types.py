"""The chat session's plain values: what it is asked to be (SessionConfig), a message's place in the token
buffer (Message), and the refusals it raises (SessionError, CacheOverflowError).

Shared by the chat loop (session.py) and its mixins (edits.py, turns.py, step_snapshot.py); import them from
kvtui.engine.chat.session.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .settings import SamplerSettings


class SessionError(Exception):
    """A request the session refused; the session is unchanged and usable."""


class PressError(SessionError):
    """The press failed on a prefill (kvpress's own assertion, a shape it does not take): the cache is as before."""


class CacheOverflowError(SessionError):
    def __init__(self, capacity: int, used: int, requested: int):
        self.capacity, self.used, self.requested = capacity, used, requested
        super().__init__(
            f"static cache overflow refused: capacity {capacity}, used {used}, requested {requested} more "
            f"({used + requested - capacity} too many). Rewind, reset, or use a larger --max-cache-len."
        )


@dataclass(frozen=True)
class SessionConfig:
    cache: str = "dynamic"  # "dynamic" | "static" | "quantized" | "offloaded" | "none" (no cache object: every
    # step is one full forward over the whole context with use_cache=False, the honest baseline)
    max_cache_len: int | None = None  # static capacity
    cache_bits: int = 4  # quantized cache: bits per value (quanto 2|4, hqq 1|2|3|4|8; fp8 ignores it)
    cache_backend: str = "quanto"  # quantized cache: "quanto" | "hqq" | "fp8"
    max_new_tokens: int = 256
    sampler: SamplerSettings = field(default_factory=SamplerSettings)
    mode: str = "chat"  # "chat" (template) | "completion" (raw prompt, tokenizer(prompt))
    system: str | None = None
    chat_tokenize: str = "template"  # "template": the template's own ids; "text": tokenizer(rendered text)
    top_k_shown: int = 10
    watch: tuple[int, ...] = ()
    prime_pad: int = 0  # reproduce the "prime the cache with pad tokens" mistake
    attention: bool = False  # opt-in: every layer's attention of the newest query, O(heads x cache) per layer per step
    compile: bool = False  # static cache only: torch.compile the one-token decode forward
    decode_threads: int | None = None  # CPU threads for one-token forwards (None: the threads of every other one)
    press: str | None = None  # --press SPEC (chat/press_spec.py): a kvpress press on the prefill of an empty cache


@dataclass
class Message:
    role: str
    content: str
    start: int  # index in the buffer where its tokens begin (assistant: first generated token)

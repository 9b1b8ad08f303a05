"""Invariant checks that turn the silent cache bugs into named alarms.

Pure functions over plain values, run by the session at every forward. State-like alarms
(cursor-mismatch, position-gap, sliding-eviction, static-capacity) fire when they start or change,
not at every step, so a long run is not flooded; `Alarms` remembers what is active.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .snapshot import BufferToken, Diagnostic, LayerInfo

CODES = (
    "tokenizer-added-special",
    "double-bos",
    "eos-in-context",
    "cursor-mismatch",
    "position-gap",
    "template-drift",
    "static-capacity",
    "sliding-eviction",
    "state-rewind",
    "pad-in-cache",
    "cache-mismatch",
    "worker-error",
    # watched programs (kvtui watch)
    "cache-edited",
    "ignored-argument",
    "padding-side",
)


@dataclass(frozen=True)
class SpecialIds:
    bos: int | None
    eos: frozenset[int]  # every id that ends generation (tokenizer, generation config, end of turn)
    pad: int | None

    @property
    def pad_is_distinct(self) -> bool:
        # Many chat models reuse EOS as pad; only a distinct pad id is a sign of padding in context.
        return self.pad is not None and self.pad not in self.eos and self.pad != self.bos


def check_feed(step: int, fed: Sequence[BufferToken], before: BufferToken | None, ids: SpecialIds, piece) -> list[Diagnostic]:
    """Alarms about the tokens one forward is about to write (before: the token already cached last)."""
    found = []
    added = [t for t in fed if t.origin == "tokenizer-added"]
    if added:
        names = ", ".join(f"{piece(t.id)!r} (id {t.id}) at position {t.position}" for t in added)
        kinds = {"BOS" if t.id == ids.bos else "EOS" if t.id in ids.eos else "special" for t in added}
        found.append(Diagnostic("tokenizer-added-special", "warning" if kinds - {"BOS"} else "info",
                                f"the tokenizer inserted {names} that the text did not contain", step))
    previous = before
    for token in fed:
        if ids.bos is not None and token.id == ids.bos and previous is not None and previous.id == ids.bos:
            found.append(Diagnostic("double-bos", "warning",
                                    f"BOS {piece(token.id)!r} at position {token.position} follows another BOS", step))
        if token.id in ids.eos and token.origin not in ("template",):
            found.append(Diagnostic("eos-in-context", "warning",
                                    f"end token {piece(token.id)!r} (id {token.id}, {token.origin}) enters the context "
                                    f"at position {token.position}: the model reads it as 'the text ended'", step))
        if (ids.pad_is_distinct and token.id == ids.pad) or token.origin == "primed":
            found.append(Diagnostic("pad-in-cache", "warning",
                                    f"pad token {piece(token.id)!r} (id {token.id}) written to the cache at position "
                                    f"{token.position}: later tokens attend to it", step))
        previous = token
    return _merge_repeats(found)


def _merge_repeats(found: list[Diagnostic]) -> list[Diagnostic]:
    """Many pads in one prefill become one alarm that says how many."""
    by_code: dict[str, list[Diagnostic]] = {}
    for d in found:
        by_code.setdefault(d.code, []).append(d)
    merged = []
    for code, items in by_code.items():
        first = items[0]
        if len(items) > 1:
            first = Diagnostic(code, first.severity, f"{first.message} (and {len(items) - 1} more in this forward)", first.step)
        merged.append(first)
    return merged


class Alarms:
    """Remembers state-like alarms so each fires once when it starts or changes."""

    def __init__(self):
        self.active: dict[str, str] = {}

    def transition(self, code: str, key: str | None, make) -> list[Diagnostic]:
        if key is None:
            self.active.pop(code, None)
            return []
        if self.active.get(code) == key:
            return []
        self.active[code] = key
        return [make()]

    def check_positions(self, step: int, positions: Sequence[int], cache_len_before: int) -> list[Diagnostic]:
        offset = positions[0] - cache_len_before if positions else 0
        contiguous = all(b == a + 1 for a, b in zip(positions, positions[1:]))
        key = None if offset == 0 and contiguous else f"{offset}:{contiguous}"
        return self.transition("position-gap", key, lambda: Diagnostic(
            "position-gap", "error",
            f"fed positions start at {positions[0]} but the cache already holds {cache_len_before} tokens "
            f"(offset {offset:+d}{'' if contiguous else ', and they are not contiguous'}): RoPE sees the wrong distances",
            step))

    def check_cursor(self, step: int, cursor: int, cache_len: int) -> list[Diagnostic]:
        gap = cursor - cache_len  # news only when the gap appears or changes
        return self.transition("cursor-mismatch", None if gap == 0 else str(gap), lambda: Diagnostic(
            "cursor-mismatch", "error",
            f"cursor (next position {cursor}) differs from the cache length {cache_len} by {gap:+d}", step))

    def check_layers(self, step: int, layers: Sequence[LayerInfo], capacity: int | None, cache_len: int,
                     reserve: int) -> list[Diagnostic]:
        found = []
        evicting = [layer for layer in layers if layer.held_from > 0]
        key = None
        if evicting:
            key = "on"
            first = evicting[0]
            if "sliding-eviction" not in self.active:
                found.append(Diagnostic(
                    "sliding-eviction", "info",
                    f"{len(evicting)} of {len(layers)} layers ({first.kind}, window {first.window}) no longer hold "
                    f"positions < {first.held_from}; full layers still hold all {cache_len}", step))
        if key is None:
            self.active.pop("sliding-eviction", None)
        else:
            self.active["sliding-eviction"] = key
        if capacity is not None:
            left = capacity - cache_len
            near = left <= max(reserve, capacity // 10)
            found += self.transition("static-capacity", "near" if near else None, lambda: Diagnostic(
                "static-capacity", "warning",
                f"static cache {cache_len}/{capacity} full: {left} slots left", step))
        return found

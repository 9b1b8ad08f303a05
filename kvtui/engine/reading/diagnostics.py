"""The step rules: the invariant checks that turn the silent cache bugs of one forward into named alarms.

Each rule is a function of plain values (tokens, positions, layer infos), run at every forward by kvtui's
own session and by the step builder of a watched program alike. The codes and their severity rules are the
one registry's (records/codes.py); silent_rules.py, batching/checks.py and server/rules.py use the same codes.
State-like rules (cursor-mismatch, position-gap, sliding-eviction, static-capacity, ignored-argument) fire when
their condition starts or changes, not at every step, so a long run is not flooded: they are handed the
`AlarmMemory` that remembers what is active (`alarms.Alarms`) and record their state there; every other rule is
pure.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

from ..records.codes import CODES as REGISTRY
from ..records.snapshot import BufferToken, Diagnostic, LayerInfo
from .prefixes import common_prefix

CODES = tuple(REGISTRY)  # the registered codes (records/codes.py: each code's meaning and severity rule)


@dataclass(frozen=True)
class SpecialIds:
    bos: int | None
    eos: frozenset[int]  # every id that ends generation (tokenizer, generation config, end of turn)
    pad: int | None

    @cached_property
    def notable(self) -> frozenset[int]:
        """The ids a fed token must be one of for check_feed to say anything of it (BOS, pad, the ends)."""
        return frozenset(i for i in (self.bos, self.pad) if i is not None) | self.eos

    @property
    def pad_is_distinct(self) -> bool:
        # Many chat models reuse EOS as pad; only a distinct pad id is a sign of padding in context.
        return self.pad is not None and self.pad not in self.eos and self.pad != self.bos


def token_text(piece: str, token_id: int, raw: str | None = None) -> str:
    """`'piece' (id N)` for messages: escaped (repr), and a piece that decodes to a lone replacement
    character (one byte of a multi-byte character) shows the token's raw form instead."""
    if token_id < 0:
        return "<embeds>" if token_id == -1 else "<unknown>"
    if "\ufffd" in piece:
        piece = raw if raw and "\ufffd" not in raw else piece.replace("\ufffd", "\\ufffd")
    return f"{piece!r} (id {token_id})"


_ID, _ORIGIN = operator.attrgetter("id"), operator.attrgetter("origin")
_NOTABLE_ORIGINS = frozenset(("tokenizer-added", "primed"))  # the origins check_feed speaks of whatever the id


def feed_is_plain(fed: Sequence[BufferToken], ids: SpecialIds) -> bool:
    """No BOS, pad or end id, nothing the tokenizer added or primed (most feeds): check_feed has nothing to say
    (a caller that asks first skips passing it the rest)."""
    return ids.notable.isdisjoint(map(_ID, fed)) and _NOTABLE_ORIGINS.isdisjoint(map(_ORIGIN, fed))


def check_feed(
    step: int,
    fed: Sequence[BufferToken],
    before: BufferToken | None,
    ids: SpecialIds,
    piece,
    *,
    prompt_end: bool = False,
    at: str = "",
    label=None,
) -> list[Diagnostic]:
    """Alarms about the tokens one forward is about to write (before: the token already cached last), for
    kvtui's own chat and a watched program alike. `prompt_end`: the forward feeds a whole prompt (a
    watched prefill), so an end token as its last token ends the text. `label(t)` names a token."""
    if feed_is_plain(fed, ids):
        return []
    label = label or (lambda t: token_text(piece(t.id), t.id))
    attended = [t for t in fed if t.origin != "pad"]
    found = _tokenizer_added(step, attended, before, ids, label, at)
    previous = before if before is None or before.origin != "pad" else None
    for token in attended:
        if ids.bos is not None and token.id == ids.bos and previous is not None and previous.id == ids.bos:
            found.append(
                Diagnostic(
                    "double-bos",
                    "warning",
                    f"BOS {label(token)} at position {token.position} follows another BOS" + at,
                    step,
                )
            )
        previous = token
    pads = [t for t in attended if (ids.pad is not None and t.id == ids.pad) or t.origin == "primed"]
    # a pad id that doubles as EOS/BOS is a pad only in a run: chats hold single <|im_end|>s
    if pads and (
        ids.pad_is_distinct or any(t.origin == "primed" for t in pads) or _longest_run(attended, ids.pad) >= 2
    ):
        found.append(
            Diagnostic(
                "pad-in-cache",
                "warning",
                f"{len(pads)} pad token(s) {label(pads[0])} written to the cache with attention from position "
                f"{pads[0].position}: later tokens attend to them (mask them or do not feed them)" + at,
                step,
            )
        )
    if not (pads and ids.pad in ids.eos):  # the pad id is an end id: those ends are pads, not news here
        found += _end_in_context(step, attended, ids, label, at, prompt_end)
    return _merge_repeats(found)


def _tokenizer_added(
    step: int, attended: list[BufferToken], before: BufferToken | None, ids: SpecialIds, label, at: str
) -> list[Diagnostic]:
    """tokenizer-added-special: tokens the tokenizer put in that the text did not contain."""
    added = [t for t in attended if t.origin == "tokenizer-added"]
    if not added:
        return []
    if (
        added == attended[:1]
        and before is None
        and added[0].id == ids.bos
        and not (len(attended) > 1 and attended[1].id == ids.bos)
    ):
        return []  # one BOS in front of an empty cache is what the model expects: not news
    names = ", ".join(f"{label(t)} at position {t.position}" for t in added)
    kinds = {"BOS" if t.id == ids.bos else "EOS" if t.id in ids.eos else "special" for t in added}
    return [
        Diagnostic(
            "tokenizer-added-special",
            "warning" if kinds - {"BOS"} else "info",
            f"the tokenizer inserted {names} that the text did not contain" + at,
            step,
        )
    ]


def _end_in_context(
    step: int, attended: list[BufferToken], ids: SpecialIds, label, at: str, prompt_end: bool
) -> list[Diagnostic]:
    """eos-in-context: an end token the model will read as 'the text ended' (not one it generated)."""
    ends = [
        t
        for t in attended
        if t.id in ids.eos
        and t.origin != "primed"
        and (
            t.origin == "tokenizer-added"
            or t.origin not in ("template", "fed")
            or (prompt_end and len(attended) > 1 and t is attended[-1])
        )
    ]
    if not ends:
        return []
    t = ends[0]
    how = {"tokenizer-added": "added by the tokenizer", "fed": "last of the prompt"}.get(t.origin, t.origin)
    return [
        Diagnostic(
            "eos-in-context",
            "warning",
            f"end token {label(t)} ({how}) enters the context at position {t.position}: the model reads it as "
            f"'the text ended'" + at,
            step,
        )
    ]


def _longest_run(tokens: Sequence[BufferToken], token_id: int | None) -> int:
    best = run = 0
    for t in tokens:
        run = run + 1 if t.id == token_id else 0
        best = max(best, run)
    return best


def _merge_repeats(found: list[Diagnostic]) -> list[Diagnostic]:
    """Many pads in one prefill become one alarm that says how many."""
    by_code: dict[str, list[Diagnostic]] = {}
    for d in found:
        by_code.setdefault(d.code, []).append(d)
    merged = []
    for code, items in by_code.items():
        first = items[0]
        if len(items) > 1:
            first = Diagnostic(
                code, first.severity, f"{first.message} (and {len(items) - 1} more in this forward)", first.step
            )
        merged.append(first)
    return merged


class AlarmMemory(Protocol):
    """What a state-like rule is handed: the alarms active now (code -> the key of its state), and
    `transition`, which fires `make()` when a code's key starts or changes and forgets it at None.
    `alarms.Alarms` is the one kvtui keeps (per session, per watched cache)."""

    active: dict[str, str]

    def transition(self, code: str, key: str | None, make: Callable[[], Diagnostic]) -> list[Diagnostic]: ...


def check_positions(
    alarms: AlarmMemory, step: int, positions: Sequence[int], cache_len_before: int
) -> list[Diagnostic]:
    """kvtui's own forward: one row, every token attended (the rule is check_row_positions)."""
    return check_row_positions(alarms, step, [positions], [[1] * len(positions)], [cache_len_before], "")


def check_cursor(
    alarms: AlarmMemory, step: int, cursor: int, cache_len: int, whose: str = "", at: str = ""
) -> list[Diagnostic]:
    """The next write position someone keeps (the session's cursor, a program's cache_position) against
    the cache's own length: news only when the gap appears or changes."""
    gap = cursor - cache_len
    whose = whose or f"cursor (next position {cursor})"
    return alarms.transition(
        "cursor-mismatch",
        None if gap == 0 else str(gap),
        lambda: Diagnostic(
            "cursor-mismatch",
            "error",
            f"{whose} differs from the cache length by {gap:+d}: the cache holds {cache_len} tokens" + at,
            step,
        ),
    )


_HELD_FROM = operator.attrgetter("held_from")


def check_layers(
    alarms: AlarmMemory, step: int, layers: Sequence[LayerInfo], capacity: int | None, cache_len: int, reserve: int
) -> list[Diagnostic]:
    """sliding-eviction when sliding layers start dropping positions, static-capacity when a static cache
    nears full (`reserve` slots, or a tenth)."""
    # the common case (nothing evicted, nothing static) in one C-level pass: no Python per layer on every step
    evicted = max(map(_HELD_FROM, layers), default=0) > 0
    if not evicted and capacity is None:
        alarms.active.pop("sliding-eviction", None)
        return []
    found = []
    # a press's eviction (positions held per layer) is cache-evicted's, not this one's
    evicting = [layer for layer in layers if layer.held_from > 0 and layer.held is None] if evicted else []
    key = None
    if evicting:
        key = "on"
        first = evicting[0]
        if "sliding-eviction" not in alarms.active:
            found.append(
                Diagnostic(
                    "sliding-eviction",
                    "info",
                    f"{len(evicting)} of {len(layers)} layers ({first.kind}, window {first.window}) no longer hold "
                    f"positions < {first.held_from}; "
                    + (
                        f"the other layers still hold all {cache_len}"
                        if len(evicting) < len(layers)
                        else "no layer holds them any more (every layer is sliding)"
                    ),
                    step,
                )
            )
    if key is None:
        alarms.active.pop("sliding-eviction", None)
    else:
        alarms.active["sliding-eviction"] = key
    if capacity is not None:
        left = capacity - cache_len
        near = left <= max(reserve, capacity // 10)
        found += alarms.transition(
            "static-capacity",
            "near" if near else None,
            lambda: Diagnostic(
                "static-capacity", "warning", f"static cache {cache_len}/{capacity} full: {left} slots left", step
            ),
        )
    return found


# ---- watched programs: what a forward or generate() was asked to do -----------------------------------


def span(values: Sequence[int]) -> str:
    values = list(values)
    if not values:
        return "[]"
    if values == list(range(values[0], values[0] + len(values))):
        return f"[{values[0]}..{values[-1]}]" if len(values) > 1 else f"[{values[0]}]"
    return str(values[:8])[:-1] + (", ...]" if len(values) > 8 else "]")


def request_unasked(alarms: AlarmMemory, cache_position: Sequence[int] | None, capacity: int | None) -> bool:
    """Nothing asked, nothing static (most forwards): no argument is ignored and the cursor is the cache's own, so
    both of check_request's states end here and it has nothing to check (a caller that asks first skips passing
    it the rest)."""
    if cache_position is None and capacity is None:
        if alarms.active:  # (most steps: no repeat state is active)
            alarms.active.pop("ignored-argument", None)
            alarms.active.pop("cursor-mismatch", None)
        return True
    return False


def check_request(
    alarms: AlarmMemory,
    step: int,
    *,
    cache_position: Sequence[int] | None,
    accepts_cache_position: bool,
    cache_len: int,
    n: int,
    capacity: int | None,
    at: str,
) -> list[Diagnostic]:
    """What the caller asked for: an argument this version ignores, its own cursor against the cache's,
    and a static cache this forward is about to overflow. State-like: each fires when it starts or changes."""
    if request_unasked(alarms, cache_position, capacity):
        return []
    found = alarms.transition(
        "ignored-argument",
        at if cache_position is not None and not accepts_cache_position else None,
        lambda: Diagnostic(
            "ignored-argument",
            "warning",
            f"cache_position={span(cache_position or ())} was passed but this transformers version ignores it (models "
            f"take no cache_position since 5.4): the model wrote at the cache's own length {cache_len} and took "
            f"positions from position_ids or that length" + at,
            step,
        ),
    )
    first = cache_position[0] if cache_position else cache_len
    found += check_cursor(
        alarms, step, first, cache_len, whose=f"the caller's own cursor (cache_position starts at {first})", at=at
    )
    if capacity is not None and cache_len + n > capacity:
        found.append(
            Diagnostic(
                "static-capacity",
                "error",
                f"this forward writes {n} tokens into a static cache holding {cache_len} of {capacity}: "
                f"{cache_len + n - capacity} too many (index_copy_ IndexError follows)" + at,
                step,
            )
        )
    return found


def check_row_positions(
    alarms: AlarmMemory,
    step: int,
    applied: Sequence[Sequence[int]],
    masks: Sequence[Sequence[int]],
    attended_before: Sequence[int],
    at: str,
    because: str = "",
) -> list[Diagnostic]:
    """Applied positions must continue what each row has attended to so far (left pads excluded); `because` says
    where that count comes from when it is not the cache's length (a compressed cache)."""
    if all(map(all, masks)) and list(map(list, applied)) == list(
        map(list, map(range, attended_before, map(operator.add, attended_before, map(len, applied))))
    ):  # every token attended, each row continuing its count (most forwards): told by C-level passes, no gap
        alarms.active.pop("position-gap", None)
        return []
    key, message = None, ""
    for row, (positions, mask, real) in enumerate(zip(applied, masks, attended_before)):
        for i, position in enumerate(positions):
            if not mask[i]:
                continue
            if position != real:
                key = f"{position - real:+d}"
                where = f"row {row} token {i}" if len(applied) > 1 else f"token {i}"
                message = (
                    f"{where} was applied at position {position} but {real} attended tokens precede it "
                    f"(offset {position - real:+d}): RoPE sees the wrong distances{because}"
                )
                break
            real += 1
        if key:
            break
    return alarms.transition("position-gap", key, lambda: Diagnostic("position-gap", "error", message + at, step))


def check_padding_side(step: int, masks: Sequence[Sequence[int]], at: str) -> list[Diagnostic]:
    for row, mask in enumerate(masks):
        if len(mask) < 2:
            continue
        right_pads = len(mask) - 1 - max((i for i, m in enumerate(mask) if m), default=len(mask) - 1)
        if right_pads:
            return [
                Diagnostic(
                    "padding-side",
                    "warning",
                    f"row {row} ends with {right_pads} pad(s): its next token is predicted from padding "
                    f"(decoder-only models need padding_side='left')" + at,
                    step,
                )
            ]
    return []


def check_drift(
    step: int, cached: Sequence[int], rendering: Sequence[int], fed: Sequence[int], label, at: str
) -> list[Diagnostic]:
    """The program fed the tail of a rendering (a tokenizer call kvtui saw): its head must equal what the
    cache holds, else the cached prefix is stale."""
    start = len(rendering) - len(fed)
    if start <= 0 or list(rendering[start:]) != list(fed) or not cached:
        return []
    held = list(cached[-start:]) if len(cached) >= start else list(cached)
    if held == list(rendering[:start]) or any(i < 0 for i in held):
        return []
    index = common_prefix(held, list(rendering[:start]))  # no unknown id in `held` (returned above)
    have = label(held[index]) if index < len(held) else "nothing"
    want = label(rendering[index]) if index < start else "nothing"
    return [
        Diagnostic(
            "template-drift",
            "warning",
            f"the program fed tokens {start}.. of a rendering whose first {start} tokens differ from the cache at "
            f"index {index} (cache has {have}, the rendering {want}): the cached prefix is stale" + at,
            step,
        )
    ]


STALE_MIN_REFED = 8  # a fed prefix this long that repeats the cache's own start is a re-fed prompt


def check_stale_prompt(
    step: int,
    cache_name: str,
    cached: Sequence[int],
    prompt: Sequence[int],
    label,
    at: str,
    fed_from: int | None = None,
) -> list[Diagnostic]:
    """generate() was handed a cache and a prompt: it feeds only prompt[len(cache):] (`fed_from`; the whole
    prompt again when the cache is at least as long), so the cache must hold a prefix of the prompt.
    Unknown cached tokens (< 0) are taken on trust."""
    held = len(cached)
    if not held or not prompt:
        return []
    index = next((i for i, (a, b) in enumerate(zip(cached, prompt)) if a >= 0 and a != b), None)
    if index is None:
        return []
    fed_from = held if fed_from is None else fed_from
    if fed_from > 0:
        never = max(0, min(fed_from, len(prompt)) - index)
        what = (
            f"generate() feeds only prompt tokens {fed_from}.., so {never} prompt token(s) were never fed and "
            f"the model continues the cache's text"
        )
    else:
        what = "generate() fed the whole prompt again after them, so the model reads both texts"
    return [
        Diagnostic(
            "stale-cache",
            "warning",
            f"{cache_name} holds {held} tokens that are not a prefix of the prompt it is asked to continue: they "
            f"differ at index {index} (cache {label(cached[index])}, prompt "
            f"{label(prompt[index]) if index < len(prompt) else 'nothing'}); {what} (copy the cache per prompt, or "
            "crop it to the shared prefix)" + at,
            step,
        )
    ]


def check_refed(step: int, cache_name: str, cached: Sequence[int], fed: Sequence[int], at: str) -> list[Diagnostic]:
    """A forward feeds, into a cache that already holds tokens, a prompt that starts with the cache's own
    first tokens: the program re-feeds a prompt into a cache it did not reset or copy."""
    if not cached or len(fed) < 2:
        return []
    same = common_prefix(cached, fed)
    if same < 2 or same < min(len(cached), STALE_MIN_REFED):
        return []
    return [
        Diagnostic(
            "stale-cache",
            "warning",
            f"{cache_name} already holds {len(cached)} tokens and this forward feeds a prompt whose first {same} "
            "tokens repeat the cache's own start: the model sees them twice (copy or reset the cache per prompt)" + at,
            step,
        )
    ]


RECOMPUTED_MIN = 8  # fewer re-encoded tokens are the unavoidable shared start of two prompts


def recomputed_prefix(
    step: int, cache_name: str, held_before: int, ids: Sequence[int], others, forward_ms: float, fed: int, at: str
) -> tuple[list[Diagnostic], int, float]:
    """A prefill wrote ids[held_before:] into a cache; `others` are (name, ids, alive) of the same model's
    other caches. Tokens of this prefill that another cache already held were computed twice."""
    best, where, alive = 0, "", True
    for name, other, live in others:
        same = common_prefix(ids, other)
        if same > best:
            best, where, alive = same, name, live
    count = best - held_before
    if count < RECOMPUTED_MIN:
        return [], 0, 0.0
    cost = forward_ms * count / max(fed, 1)
    state = "still holds" if alive else "held (since discarded)"
    return (
        [
            Diagnostic(
                "recomputed-prefix",
                "info",
                f"this prefill re-encoded {count} tokens that {where} {state} (positions {held_before}..{best - 1}): "
                f"~{cost:.1f} ms of its {forward_ms:.1f} ms; pass that "
                "cache back (or a copy) to feed only the new tokens" + at,
                step,
            )
        ],
        count,
        cost,
    )


def check_ranks(step: int, ranks: dict[int, tuple | None]) -> list[Diagnostic]:
    """rank-desync: the ranks of one tensor-parallel run disagree at the same step. `ranks`: rank ->
    (fed ids, positions, cache length after the forward), or None for a rank that made no such step.
    Every rank of a collective forward must feed the same ids at the same positions; one that differs
    (or is missing) computes on another context, and the all-reduce mixes the two without an error."""
    made = {rank: facts for rank, facts in ranks.items() if facts is not None}
    if not made or (len(made) == len(ranks) and len(set(made.values())) == 1):
        return []
    missing = sorted(rank for rank, facts in ranks.items() if facts is None)
    first, reference = min(made.items())
    differ = []
    for rank, facts in sorted(made.items()):
        if facts == reference:
            continue
        what = [name for name, a, b in zip(("fed ids", "positions", "cache length"), facts, reference) if a != b]
        differ.append(
            f"rank {rank} differs from rank {first} in its {', '.join(what)} "
            f"({_facts_text(facts)} vs {_facts_text(reference)})"
        )
    if missing:
        differ.append(f"rank(s) {', '.join(map(str, missing))} made no forward {step}")
    return [Diagnostic("rank-desync", "error", f"ranks disagree at forward {step}: " + "; ".join(differ), step)]


def _facts_text(facts: tuple) -> str:
    ids, positions, length = facts
    return f"ids {span(ids) if len(ids) > 8 else list(ids)}, positions {span(positions)}, cache {length}"


ATTENDED_SHARE = 0.01  # a share of the newest query's attention (mean over layers) worth an alarm


def check_attention(
    step: int,
    pads: Sequence[int],
    regions: Sequence[str],
    shares: Sequence[Sequence[float] | None],
    memory: dict,
    at: str = "",
    newest: int | None = None,
) -> list[Diagnostic]:
    """attended-pads: pads (`pads`: their buffer positions; masked pads, a primed prefix, runs of the pad id)
    receive attention that the mask should have removed, from a query that is not a pad itself (`newest`: its
    buffer position): the share (mean over the layers with attention, and the layer that gives them most) and
    their positions, read from the captured attention. Said when it starts and when the pads change (`memory`:
    the caller's, one per cache); attention to the first token of a correct chat is normal."""
    if newest is not None and pads and pads[-1] == newest:
        return []  # the query is a pad itself (a priming pass): what it attends to is not the question
    if "pad" not in regions:
        memory.pop("pads", None)
        return []
    column = list(regions).index("pad")
    per_layer = [(i, row[column]) for i, row in enumerate(shares) if row is not None]
    if not per_layer:
        return []
    mean = sum(share for _, share in per_layer) / len(per_layer)
    if mean < ATTENDED_SHARE:
        memory.pop("pads", None)
        return []
    layer, most = max(per_layer, key=lambda pair: pair[1])
    where = _spans(pads) if pads else "the pad positions"
    if memory.get("pads") == where:
        return []
    memory["pads"] = where
    return [
        Diagnostic(
            "attended-pads",
            "warning",
            f"the newest token puts {mean:.0%} of its attention (mean over {len(per_layer)} layers; {most:.0%} in "
            f"layer {layer}) on pad tokens at {where} that the mask should have removed" + at,
            step,
        )
    ]


def _spans(positions: Sequence[int]) -> str:
    """`positions 0–31, 40` (at most 4 spans, then `…`)."""
    spans: list[list[int]] = []
    for p in sorted(positions):
        if spans and p == spans[-1][1] + 1:
            spans[-1][1] = p
        else:
            spans.append([p, p])
    text = ", ".join(f"{a}–{b}" if b > a else f"{a}" for a, b in spans[:4])
    return ("positions " if len(positions) > 1 else "position ") + text + (", …" if len(spans) > 4 else "")

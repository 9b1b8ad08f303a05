"""The ONE rulebook: the invariant checks that turn the silent cache bugs into named alarms.

Each rule is a function of plain values (tokens, positions, layer infos), run at every forward by kvtui's
own session and by the step builder of a watched program alike. State-like rules (cursor-mismatch,
position-gap, sliding-eviction, static-capacity, ignored-argument) fire when their condition starts or
changes, not at every step, so a long run is not flooded: they are handed the `AlarmMemory` that
remembers what is active (`alarms.Alarms`) and record their state there; every other rule is pure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..records.snapshot import BufferToken, Diagnostic, LayerInfo

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
    "stale-cache",
    "recomputed-prefix",
    # a watched command's tree (kvtui watch -- COMMAND)
    "rank-desync",
    # silent cache bugs users report (the rules at the end of this module)
    "cache-written-without-use-cache",
    "edit-changed-nothing",
    "mask-length",
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


def token_text(piece: str, token_id: int, raw: str | None = None) -> str:
    """`'piece' (id N)` for messages: escaped (repr), and a piece that decodes to a lone replacement
    character (one byte of a multi-byte character) shows the token's raw form instead."""
    if token_id < 0:
        return "<embeds>" if token_id == -1 else "<unknown>"
    if "\ufffd" in piece:
        piece = raw if raw and "\ufffd" not in raw else piece.replace("\ufffd", "\\ufffd")
    return f"{piece!r} (id {token_id})"


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


def check_layers(
    alarms: AlarmMemory, step: int, layers: Sequence[LayerInfo], capacity: int | None, cache_len: int, reserve: int
) -> list[Diagnostic]:
    """sliding-eviction when sliding layers start dropping positions, static-capacity when a static cache
    nears full (`reserve` slots, or a tenth)."""
    found = []
    evicting = [layer for layer in layers if layer.held_from > 0]
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
                    f"positions < {first.held_from}; full layers still hold all {cache_len}",
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
) -> list[Diagnostic]:
    """Applied positions must continue what each row has attended to so far (left pads excluded)."""
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
                    f"(offset {position - real:+d}): RoPE sees the wrong distances"
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


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two id sequences; an unknown id (< 0) matches nothing."""
    n = 0
    for x, y in zip(a, b):
        if x != y or x < 0:
            break
        n += 1
    return n


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
    index = next((i for i, (a, b) in enumerate(zip(held, rendering[:start])) if a != b), min(len(held), start))
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


# ---- silent cache bugs users report: a cache that changed where the program said it must not, or did not
# change where the program asked it to (watched programs) ----------------------------------------------------


def check_written_without_use_cache(
    step: int, cache_name: str, before: int, after: int, passed: bool | None, at: str
) -> list[Diagnostic]:
    """A forward told not to use a cache (`use_cache=False` passed, `passed` False; or not passed where the
    model's config defaults it off, `passed` None) that still wrote into the cache it was handed: transformers
    5.x writes the fed tokens anyway (5.24: 16 -> 19), so every later forward attends to tokens the text never
    had. `before`/`after`: the cache's length around the forward."""
    if after <= before:
        return []
    how = "use_cache=False" if passed is False else "use_cache unset (the model's config says False)"
    written = after - before
    return [
        Diagnostic(
            "cache-written-without-use-cache",
            "warning",
            f"a forward with {how} wrote {written} token(s) into {cache_name} ({before} -> {after}){at}: "
            f"later forwards attend to them; score on a copy (copy.deepcopy) or crop(-{written}) after it",
            step,
        )
    ]


def check_edit_changed_nothing(
    step: int, call: str, method: str, first_argument: int | None, before: int, after: int
) -> list[Diagnostic]:
    """A cache edit that asked for fewer tokens and changed nothing: `crop(0)` (4.x: keep none; 5.x: remove
    none), `crop(n)` with n >= the length (4.x: keep n), or a `reset()` after which tokens remain. `call`: the
    edit as written and where (`DynamicCache#1.crop(0) at [prog.py:12]`)."""
    if before <= 0:
        return []
    if method == "reset" and after > 0:
        what = f"left {after} of {before} tokens: the next forward continues them"
    elif method == "crop" and after == before and first_argument == 0:
        what = (
            f"kept all {before} tokens: crop's argument is the number of tokens to remove on transformers 5.x "
            f"(crop(-n)), so crop(0) removes none (on 4.x it kept none); to empty it use reset() or crop(-{before})"
        )
    elif method == "crop" and after == before and first_argument is not None and first_argument >= before:
        what = f"kept all {before} tokens: it asked to keep {first_argument}, no fewer than it holds"
    else:
        return []
    return [Diagnostic("edit-changed-nothing", "warning", f"{call} {what}", step)]


# ---- silent cache bugs users report: positions a program derives from the wrong length (watched programs) --


def positions_stuck_at_window(
    applied: Sequence[Sequence[int]], attended_before: Sequence[int], window: int | None
) -> bool:
    """Do row 0's positions sit at a sliding layer's length (window - 1 or window) while more tokens precede
    them? The mark of a loop that reads its cache length from a sliding layer (`cache.layers[0].keys.shape[-2]`,
    `past_key_values[0][0].shape[2]`): that layer holds at most its window, so the positions stop growing."""
    if not window or not applied or not applied[0] or not attended_before:
        return False
    first, real = applied[0][0], attended_before[0]
    return first in (window - 1, window) and real > window


def check_window_positions(alarms: Alarms, step: int, first: int, real: int, window: int, at: str) -> list[Diagnostic]:
    """position-gap, said once for its cause: the positions stopped at a sliding layer's length (`first`)
    while `real` tokens precede them. Later forwards stuck at the same length are the same cause (no new
    alarm: the key is the stuck position, not the growing offset)."""
    return alarms.transition(
        "position-gap",
        f"window@{first}",
        lambda: Diagnostic(
            "position-gap",
            "error",
            f"token 0 was applied at position {first} but {real} attended tokens precede it: the positions stop "
            f"growing at {first}, the length a sliding layer holds (window {window}), so the program reads its "
            f"cache length from a sliding layer; read cache.get_seq_length() (a full layer's length){at}",
            step,
        ),
    )


def check_mask_length(step: int, cache_name: str, columns: int, cached: int, fed: int, at: str) -> list[Diagnostic]:
    """An `attention_mask` handed with a cache must have one column per cached token plus one per fed token
    (`cached + fed`). One longer or shorter does not raise: transformers reads its columns against the cache's
    slots anyway (5.x: the first `cached + fed`; positions from the cache's length, while generate() and
    kvtui's own bookkeeping count the mask's ones), so tokens are masked by another token's column."""
    expected = cached + fed
    if columns == expected:
        return []
    how = f"{columns - expected} more" if columns > expected else f"{expected - columns} fewer"
    return [
        Diagnostic(
            "mask-length",
            "warning",
            f"attention_mask has {columns} columns, {how} than {cache_name}'s {cached} cached + {fed} fed tokens "
            f"({expected}): its columns do not line up with the cache's slots, and positions counted from it "
            f"disagree with the cache's length; extend the mask by exactly the tokens fed{at}",
            step,
        )
    ]


# ---- silent cache bugs users report: a cache generate() made other than the program asked ----------------


def check_cache_config_size(step: int, cache_name: str, asked: int, made: int, at: str) -> list[Diagnostic]:
    """generate(cache_implementation="static", cache_config={"max_cache_len": N}) made a static cache of
    another capacity: transformers (4.57, 5.24) sizes it to the prompt plus max_new_tokens whatever N says,
    so a program that keeps the cache for a longer continuation overflows it later, far from the cause."""
    if asked == made:
        return []
    return [
        Diagnostic(
            "ignored-argument",
            "warning",
            f"cache_config max_cache_len={asked} was ignored: generate() made {cache_name} with room for {made} "
            f"tokens (the prompt plus max_new_tokens); to size it yourself pass "
            f"StaticCache(config=model.config, max_cache_len={asked}) as past_key_values{at}",
            step,
        )
    ]


# ---- one alarm per cause: a right-padded prefill's later position gaps are counted under padding-side -----

_RIGHT_PADDED = "padding-side"  # the key in a cache's Alarms.active while its last prefill was right-padded


def note_right_padding(alarms: Alarms, padded: bool) -> None:
    """Remember (per cache) whether its last prefill had rows ending with pads (padding-side said)."""
    if padded:
        alarms.active[_RIGHT_PADDED] = "right"
    else:
        alarms.active.pop(_RIGHT_PADDED, None)


def counted_under_padding(alarms: Alarms, gaps: list[Diagnostic]) -> list[Diagnostic]:
    """position-gap alarms on a cache whose prefill was right-padded: the rows' positions no longer match
    their tokens because of those pads (5.x generate() places the new tokens after the pad slots), one cause
    already named; they are said as padding-side, so the group counts them instead of a second reason."""
    if alarms.active.get(_RIGHT_PADDED) != "right":
        return gaps
    return [
        Diagnostic("padding-side", "warning", f"the right padding again: {d.message}", d.step)
        if d.code == "position-gap"
        else d
        for d in gaps
    ]

"""The rulebook's chapter on the silent cache bugs users report (issue 37): a cache that changed where the
program said it must not, positions derived from the wrong length, a cache generate() made other than the
program asked, and one cause counted once. Pure functions, or handed the cache's `AlarmMemory`, as the rules
in diagnostics.py are; the codes are the registry's (records/codes.py)."""

from __future__ import annotations

from collections.abc import Sequence

from ..records.snapshot import Diagnostic
from .diagnostics import AlarmMemory

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
        what = (
            f"left {after} of {before} tokens: the next forward continues at position {after}, attending to what those"
            " slots hold now (transformers 4.x's reset() zeroes the keys and values in place and keeps the length;"
            " to empty the cache use crop(0) there, or a new cache)"
        )
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


def check_window_positions(
    alarms: AlarmMemory, step: int, first: int, real: int, window: int, at: str
) -> list[Diagnostic]:
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


def note_right_padding(alarms: AlarmMemory, padded: bool) -> None:
    """Remember (per cache) whether its last prefill had rows ending with pads (padding-side said)."""
    if padded:
        alarms.active[_RIGHT_PADDED] = "right"
    else:
        alarms.active.pop(_RIGHT_PADDED, None)


def counted_under_padding(alarms: AlarmMemory, gaps: list[Diagnostic]) -> list[Diagnostic]:
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

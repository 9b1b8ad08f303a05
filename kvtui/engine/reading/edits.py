"""The one `recomputed-prefix` edit rule: where a new prompt leaves a held text and that text goes on after the
difference, the tokens after it were computed again although a cache held them (prefix caching matches a prompt's
start only). Judged the same way on a server's cached chains (server/rules.py) and on a watched batching
server's requests (batching/checks.py), with the same bounds and the same words.

The edit may be a token in place of another, text put in, left out, or replaced by text of another length: it is
found where the held text goes on within REALIGN_SEARCH tokens of the difference on either side, for at least
REALIGN_MIN tokens, or to the end of what the cache holds (at least INSERT_PROBE) after a one-token swap or a
pure insertion: a chat template's turn end after another question is no miss.
Cost: O(REALIGN_SEARCH * INSERT_PROBE) per judged prompt, never O(tokens held).

Also here: the one `short-prompt` judgement (a prompt too short to fill one cache block shares nothing) and the one
`prefix-under-block` judgement (a prompt that shares a start with a held one, but less than one block of it, reuses
none of it: hybrid attention + Mamba models' blocks are hundreds of tokens), with its words, for both kinds of origin.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from heapq import heappop, heappush

from .prefixes import _has_negative

INSERT_PROBE = 6  # held tokens looked for after the difference (text put before shared text)
REALIGN_SEARCH = 64  # ... within this many tokens of it, on either side (the edit's length bound)
REALIGN_MIN = 24  # tokens the held text must go on for after an edit other than a one-token swap or insertion
REALIGN_LENGTH = REALIGN_SEARCH + INSERT_PROBE + REALIGN_MIN  # held tokens read after a difference


def realigned(cached: Sequence[int], tokens: Sequence[int], common: int) -> tuple[int, int] | None:
    """Where the held text `cached` goes on in `tokens` after their difference at `common`: (left, put), the held
    tokens left out (or replaced) and the prompt's tokens put in their place, the smallest edit first; None where
    it does not go on within REALIGN_SEARCH tokens on either side. The held text must go on for REALIGN_MIN tokens,
    or, after a one-token swap or a pure insertion, for the INSERT_PROBE or more tokens the cache still holds (where
    the prompt ends first, as a chat template's turn end after another one-token question does, it is no miss)."""
    cached, tokens = _longs(cached), _longs(tokens)
    # compared as bytes (8 per token): a bytes slice is one C call, where an array slice and its tobytes are two
    step = cached.itemsize
    span = INSERT_PROBE * step
    window = tokens[common : common + REALIGN_SEARCH + INSERT_PROBE].tobytes()
    held = cached[common : common + REALIGN_SEARCH + INSERT_PROBE].tobytes()
    # held INSERT_PROBE-grams looked for in the prompt after the difference (its first place, aligned to a token),
    # the nearest left first; the candidates tried in order of left + put, then left: once `left` is passed, every
    # candidate at left + put <= left is before any found later, and is tried then (the rest need not be searched)
    found: list[tuple[int, int, int]] = []
    for left in range(min(REALIGN_SEARCH, len(held) // step - INSERT_PROBE) + 1):  # the cache holds enough after
        probe = held[left * step : left * step + span]
        at = window.find(probe)
        while at >= 0 and at % step:
            at = window.find(probe, at + 1)
        if at >= 0 and (left or at):
            heappush(found, (left + at // step, left, at // step))
        while found and found[0][0] <= left:
            _, was_left, put = heappop(found)
            if _goes_on(cached, tokens, common, was_left, put):
                return was_left, put
    while found:
        _, left, put = heappop(found)
        if _goes_on(cached, tokens, common, left, put):
            return left, put
    return None


def _goes_on(cached: array, tokens: array, common: int, left: int, put: int) -> bool:
    """The held text goes on after the edit for REALIGN_MIN tokens, or (a swap or an insertion) to its end: the
    common run of the two after it (an unknown id matches nothing) asked as two comparisons of slices (C), not
    counted token by token."""
    held, fresh = cached[common + left :], tokens[common + put :]
    if len(held) >= REALIGN_MIN and held[:REALIGN_MIN] == fresh[:REALIGN_MIN]:
        if not _has_negative(held, REALIGN_MIN):
            return True  # the run is REALIGN_MIN or more
    if not (left == 0 or (left == 1 and put >= 1)):
        return False
    n = len(held)  # ... or it runs to the end of what the cache holds: `held` is the start of `fresh`, all known
    return (
        common + left + n == len(cached)
        and n <= len(fresh)
        and held == fresh[:n]
        and not (n and _has_negative(held, n))
    )


def edit_words(cached: Sequence[int], tokens: Sequence[int], common: int, edit: tuple[int, int], text: Callable) -> str:
    """What the edit at `common` was, in words: text put before the held text (a timestamp, an id), left out, or
    replaced by text of another length; "" for one token in place of another (the note names both already).
    `text(ids)` decodes a run of ids."""
    left, put = edit
    if left == 0:
        inserted = text(tokens[common : common + put]).strip()
        return f" ({inserted!r} was put before the cached text, which follows {put} tokens later)"
    if left == 1 and put == 1:
        return ""
    removed = text(cached[common : common + left]).strip()
    if put == 0:
        return f" ({removed!r} was left out; the cached text follows right after)"
    new = text(tokens[common : common + put]).strip()
    if removed and new.endswith(removed) and put > left:  # text put before (a token merged with the next)
        inserted = new[: -len(removed)].strip()
        return f" ({inserted!r} was put before the cached text, which follows {put - left} tokens later)"
    return f" ({removed!r}, {_count(left)}, became {new!r}, {_count(put)}; the cached text follows)"


def differing_tokens(edit: tuple[int, int]) -> int:
    """How many of the prompt's tokens the edit put where the held text was (text put before a held token it merged
    with counts once): what varying-start compares between prompts."""
    left, put = edit
    return put - 1 if left == 1 and put >= 2 else put


def short_prompt(prompt_length: int, block_tokens: int) -> bool:
    """A prompt shorter than one block: a prefix cache stores and matches whole blocks only, so nothing of it can be
    reused by another request (a prompt of at least one block fills one, which a longer prompt can match)."""
    return block_tokens > 0 and 0 < prompt_length < block_tokens


UNDER_BLOCK_MIN = 16  # shared tokens before prefix-under-block is said: what blocks of 16 (vLLM's default on a GPU)
# would have shared; fewer is the start every chat template gives (and never a cause with blocks of 16 or fewer)


def under_one_block(shared: int, block_tokens: int) -> bool:
    """A prompt's start shared with a held prompt, at least UNDER_BLOCK_MIN tokens of it but fewer than one block: a
    prefix cache stores and matches whole blocks only, so none of it could be reused (a shared start of at least one
    block fills one that the other prompt can match)."""
    return UNDER_BLOCK_MIN <= shared < block_tokens


def under_block_words(shared: int, block_tokens: int, count: int) -> str:
    """What prefix-under-block says after naming the two prompts (the same words for every kind of origin)."""
    return (
        f"shares its first {_count(shared)} with it, fewer than one block of {block_tokens} tokens: a prefix cache "
        "stores and matches whole blocks, so none of them was reused and the prompt was computed from its first token "
        f"({count} such prompt{'s' if count != 1 else ''} so far; smaller blocks, or a shared start of at least one "
        "block, let prompts share)"
    )


def _count(count: int) -> str:
    return f"{count} token" if count == 1 else f"{count} tokens"


def _longs(ids: Sequence[int]) -> array:
    return ids if isinstance(ids, array) and ids.typecode == "l" else array("l", (int(i) for i in ids))

"""reading/edits.py's realignment search (bytes n-grams, one dict) against a straightforward reference computation
of the same rule, on randomized edits: the notes that read it must not change with how it is computed."""

from __future__ import annotations

import random
from array import array

from kvtui.engine.reading.edits import INSERT_PROBE, REALIGN_MIN, REALIGN_SEARCH, realigned
from kvtui.engine.reading.prefixes import common_prefix


def reference(cached: list[int], tokens: list[int], common: int) -> tuple[int, int] | None:
    """The rule as its docstring says it, token by token: every (left, put) within REALIGN_SEARCH where the held
    INSERT_PROBE tokens at `left` first occur in the prompt at `put`, the smallest left + put first (then the
    smallest left); the first whose held text goes on REALIGN_MIN tokens, or to the cache's end after a swap or an
    insertion."""
    window = tokens[common : common + REALIGN_SEARCH + INSERT_PROBE]
    places = [window[p : p + INSERT_PROBE] for p in range(len(window) - INSERT_PROBE + 1)]
    candidates = []
    for left in range(REALIGN_SEARCH + 1):
        probe = cached[common + left : common + left + INSERT_PROBE]
        if len(probe) < INSERT_PROBE:
            break
        if probe in places:
            put = places.index(probe)
            if (left, put) != (0, 0):
                candidates.append((left + put, left, put))
    for _, left, put in sorted(candidates):
        run = 0
        a, b = cached[common + left :], tokens[common + put :]
        while run < min(len(a), len(b)) and a[run] == b[run] and a[run] >= 0:
            run += 1
        if run >= REALIGN_MIN:
            return left, put
        if (left == 0 or (left == 1 and put >= 1)) and common + left + run == len(cached):
            return left, put
    return None


def _edited(rng: random.Random) -> tuple[list[int], list[int], int]:
    vocabulary = rng.choice((3, 5, 40, 30_000))  # small vocabularies repeat n-grams: the first place matters
    cached = [rng.randrange(vocabulary) for _ in range(rng.randrange(0, 220))]
    common = rng.randrange(0, len(cached) + 1)
    left, put = (
        rng.choice((rng.randrange(0, 4), rng.randrange(0, 90))),
        rng.choice((rng.randrange(0, 4), rng.randrange(0, 90))),
    )
    tokens = cached[:common] + [rng.randrange(vocabulary) for _ in range(put)] + cached[common + left :]
    if rng.random() < 0.3:  # the prompt ends early, or the cache holds less after the difference
        tokens = tokens[: rng.randrange(common, len(tokens) + 1)]
    if rng.random() < 0.3:
        cached = cached[: rng.randrange(common, len(cached) + 1)]
    if rng.random() < 0.1 and cached:  # an unknown id (embeds) matches nothing
        cached[rng.randrange(len(cached))] = -1
    return cached, tokens, common


def test_realigned_equals_the_reference_on_random_edits():
    rng = random.Random(45)
    found = 0
    for _ in range(4000):
        cached, tokens, common = _edited(rng)
        want = reference(cached, tokens, common)
        assert realigned(array("l", cached), array("l", tokens), common) == want, (cached, tokens, common)
        assert realigned(cached, tokens, common) == want  # lists too (batching/checks.py passes lists)
        found += want is not None
    assert 1000 < found < 3000, found  # both answers occur often (the comparison tests something)


def test_common_prefix_of_arrays_equals_the_reference():
    """The negative-id check read from the items' top bytes (arrays) gives what a loop over the ids gives."""
    rng = random.Random(7)
    for _ in range(3000):
        typecode = rng.choice("bhilqBHILQ")
        low = 0 if typecode.isupper() else -3
        a = [rng.randint(low, 3) for _ in range(rng.randrange(0, 40))]
        b = list(a)
        if b and rng.random() < 0.5:
            b[rng.randrange(len(b))] = 2
        want = 0
        while want < min(len(a), len(b)) and a[want] == b[want] and a[want] >= 0:
            want += 1
        assert common_prefix(array(typecode, a), array(typecode, b)) == want, (typecode, a, b)

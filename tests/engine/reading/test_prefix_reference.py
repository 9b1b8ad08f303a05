"""reading/prefixes.py's common_prefix (an XOR of two arrays as ints) and longest_prefix (a server chain's siblings
compared in one pass) against the rule token by token, on randomized runs: every type of array, unknown ids (< 0)
anywhere, runs of other lengths and types among the candidates. The miss notes that read them must not change with
how they are computed."""

from __future__ import annotations

import random
from array import array

from kvtui.engine.reading.prefixes import common_prefix, longest_prefix

LIMITS = {"b": 2**7, "h": 2**15, "i": 2**31, "l": 2**63, "q": 2**63}


def reference(a, b) -> int:
    """How many first ids the two share, an unknown id (< 0) matching nothing."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y or x < 0:
            break
        n += 1
    return n


def reference_longest(candidates, tokens) -> tuple[int, int]:
    """The first candidate sharing the most (the oldest of equals), stopping at one that shares all of `tokens`."""
    best, common = -1, 0
    for index, other in enumerate(candidates):
        shared = reference(other, tokens)
        if shared > common:
            best, common = index, shared
            if shared == len(tokens):
                break
    return best, common


def test_common_prefix_of_arrays_is_the_reference():
    rng = random.Random(45)
    for _ in range(20_000):
        code = rng.choice("bhilq")
        limit = LIMITS[code]
        ids = [rng.randint(0, 9) if rng.random() < 0.95 else rng.randint(-limit, limit - 1) for _ in range(40)]
        a = array(code, ids[: rng.randint(0, 40)])
        b = array(code, ids[: rng.randint(0, 40)])
        if len(b) and rng.random() < 0.7:
            b[rng.randrange(len(b))] = rng.randint(-limit, limit - 1)
        assert common_prefix(a, b) == reference(a, b), (a, b)


def test_longest_prefix_is_the_reference():
    rng = random.Random(46)
    for _ in range(20_000):
        code = rng.choice("lq")
        ids = [rng.randint(-1 if rng.random() < 0.05 else 0, 5) for _ in range(rng.randint(0, 12))]
        tokens = array(code, ids)
        candidates: list = []
        for _ in range(rng.randint(0, 6)):
            other = ids[: rng.randint(0, len(ids) + 2)] + [rng.randint(0, 5) for _ in range(rng.randint(0, 3))]
            if other and rng.random() < 0.5:
                other[rng.randrange(len(other))] = rng.randint(-1, 5)
            kind = rng.random()
            candidates.append(
                array(code, other) if kind < 0.8 else array("q" if code == "l" else "l", other) if kind < 0.9 else other
            )
        assert longest_prefix(candidates, tokens) == reference_longest(candidates, tokens), (candidates, tokens)

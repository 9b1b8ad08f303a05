"""Two sequences of token ids side by side: how many first tokens they share (the one common-prefix function of
kvtui: a chat's cache against its re-rendering, a program's caches, a batch's requests, a server's cached chains),
and whether where they part only a chat template's rendering differs (the one `template-drift` judgement)."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Collection, Sequence

_LITTLE = sys.byteorder == "little"
_NON_NEGATIVE = bytes(range(128))  # a signed item's top byte below 0x80: the item is >= 0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many first ids `a` and `b` share; an unknown id (< 0: embeds, a token kvtui never saw) matches nothing.
    Two arrays of one typecode are compared as one XOR of their bytes as ints; two other sequences of one type (lists,
    tuples) in slices (C) in a bisection; never id by id in Python."""
    n = min(len(a), len(b))
    if type(a) is array and type(b) is array and a.typecode == b.typecode and _LITTLE:
        # the first differing byte of the two as bytes is the lowest set bit of their XOR as little-endian ints (C:
        # four calls, no slices compared in a bisection)
        size = a.itemsize
        differ = int.from_bytes(a[:n].tobytes(), "little") ^ int.from_bytes(b[:n].tobytes(), "little")
        if differ:
            n = ((differ & -differ).bit_length() - 1) // (8 * size)
    elif type(a) is type(b) and not isinstance(a, range):
        if a[:n] != b[:n]:
            lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if a[:mid] == b[:mid]:
                    lo = mid
                else:
                    hi = mid
            n = lo
    else:
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), n)
    if n and _has_negative(a, n):
        n = next(i for i in range(n) if a[i] < 0)
    return n


def longest_prefix(candidates: Sequence[Sequence[int]], tokens: array) -> tuple[int, int]:
    """The first of `candidates` sharing the most first ids with `tokens` (the oldest of equals), and how many:
    (its index, common_prefix(it, tokens)); (-1, 0) where none shares one. Where `tokens` holds no unknown id (< 0),
    none of what a candidate shares with it is one: each candidate of its type and length then costs one XOR of the
    two as ints (C), not a call of common_prefix. A candidate that differs at the best one's first differing id
    cannot share more (one item compared): it is passed over."""
    best, common, n = -1, 0, len(tokens)
    if not n:
        return best, common
    fast = type(tokens) is array and _LITTLE and not _has_negative(tokens, n)
    if fast:
        mine, code, bits = int.from_bytes(tokens.tobytes(), "little"), tokens.typecode, 8 * tokens.itemsize
    for index, other in enumerate(candidates):
        if len(other) <= common or other[common] != tokens[common]:
            continue  # it shares `common` ids at most: the best so far is as long, and older
        if fast and type(other) is array and len(other) == n and other.typecode == code:
            differ = int.from_bytes(other.tobytes(), "little") ^ mine
            shared = ((differ & -differ).bit_length() - 1) // bits if differ else n
        else:
            shared = common_prefix(other, tokens)
        if shared > common:
            best, common = index, shared
            if shared == n:
                break
    return best, common


def only_template_differs(
    cached: Sequence[int], fresh: Sequence[int], special: Collection[int], piece: Callable[[int], str]
) -> bool:
    """`cached` and `fresh` are two token runs from the first token where they differ: is what differs only what a
    chat template renders? Yes where one of the two tokens there is a special token or whitespace and, special
    tokens and whitespace left out, the two texts agree as far as both go (`template-drift`); no where the text
    itself differs there (another prompt, or text put before the cached text)."""
    if not cached or not fresh:
        return False
    a0, b0 = int(cached[0]), int(fresh[0])
    if not (a0 in special or b0 in special or not piece(a0).strip() or not piece(b0).strip()):
        return False
    a = "".join("".join(piece(int(t)) for t in cached if int(t) not in special).split())
    b = "".join("".join(piece(int(t)) for t in fresh if int(t) not in special).split())
    n = min(len(a), len(b))
    return bool(n) and a[:n] == b[:n]


def _has_negative(ids: Sequence[int], n: int) -> bool:
    """Whether one of the first `n` ids is < 0; for an array of signed ints, read from the top byte of each item in C
    (min() makes an int object per item, the larger part of a server chain's check)."""
    if isinstance(ids, array) and ids.typecode in "bhilq":
        size = ids.itemsize
        top = ids[:n].tobytes()[size - 1 :: size] if sys.byteorder == "little" else ids[:n].tobytes()[::size]
        return bool(top.translate(None, _NON_NEGATIVE))
    return min(ids[:n]) < 0

"""The regions' shares (attention_regions.shares) found by C-level passes are, bit for bit, what the position by
position loop found: the same weights added and subtracted in the same order."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvtui.engine.reading.attention_regions import CONTENT, ORDER, region_names, shares


def _loop_shares(index, sums, staged_classes, tail, tail_from, known, total, window, turn):
    """The loop the C-level passes replaced (kvtui before #53)."""
    classes = index.classes
    first = max(total - window, 0)
    windowed = [p for p in range(first, total) if classes[p] >= CONTENT]
    present = dict(index.counts)
    for p in windowed:
        present[classes[p]] -= 1
    rows = [c for c in ORDER if present.get(c)]
    rows += [c for c in sorted(present) if c >= CONTENT and present[c]]
    names = region_names(rows, turn)
    if windowed:
        names.insert(len([c for c in rows if c < CONTENT]), f"last {min(window, total)}")
    size = max(index.class_count(), len(sums[0]) if sums else 0) + 1
    out = []
    for layer, columns in enumerate(tail):
        acc = [0.0] * size
        for c, value in enumerate(sums[layer] if sums else ()):
            acc[c] = value
        for p in range(tail_from, known):
            old, new = staged_classes[p - tail_from], classes[p]
            if old != new:
                acc[old] -= columns[p - tail_from]
                acc[new] += columns[p - tail_from]
        for p in range(known, total):
            acc[classes[p]] += columns[p - tail_from]
        recent = 0.0
        for p in windowed:
            acc[classes[p]] -= columns[p - tail_from]
            recent += columns[p - tail_from]
        values = [acc[c] for c in rows]
        if windowed:
            values.insert(len([c for c in rows if c < CONTENT]), recent)
        out.append(tuple(values))
    return tuple(names), out


class _Index:
    def __init__(self, classes):
        self.classes = classes
        self.counts = dict(Counter(classes))

    def class_count(self):
        return max(self.counts, default=0) + 1


@pytest.mark.parametrize("seed", range(40))
def test_shares_are_the_loops_bit_for_bit(seed):
    rng = random.Random(seed)
    total = rng.randint(1, 60)
    classes = [rng.randrange(CONTENT + 4) for _ in range(total)]
    window = rng.choice([0, 1, 4, 16, 100])
    known = rng.randint(1, total)
    tail_from = max(min(known - 1, total - window), 0)
    staged = [c if rng.random() < 0.8 else rng.randrange(CONTENT + 4) for c in classes[tail_from:known]]
    layers = rng.randint(1, 4)
    width = max(Counter(classes)) + 1
    sums = [[rng.random() for _ in range(width)] for _ in range(layers)] if rng.random() < 0.9 else []
    tail = [[rng.random() / 7 for _ in range(total - tail_from)] for _ in range(layers)]
    args = (_Index(classes), sums, staged, tail, tail_from, known, total, window, 2)
    assert repr(shares(*args)) == repr(_loop_shares(*args))

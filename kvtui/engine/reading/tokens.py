"""What a tokenizer marks special and what it added around a text: read the same way for kvtui's own chat and a
watched program's tokenizer calls."""

from __future__ import annotations


def special_token_ids(tokenizer) -> frozenset[int]:
    """Declared special tokens plus added tokens flagged special (<|im_start|> is often only the latter)."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return frozenset(ids)


def find_sub(full: list[int], part: list[int]) -> int:
    """Index of `part` inside `full` (the tokenizer adds specials only around the text), or -1.
    Also how the probe finds what a watched program's tokenizer call added."""
    for front in range(0, len(full) - len(part) + 1):
        if full[front : front + len(part)] == part:
            return front
        if front > 4:  # tokenizers add at most a few tokens in front
            break
    return -1

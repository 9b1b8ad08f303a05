"""Which blocks hold the same tokens from a prompt's start, on any origin (a mixin of PrefixCache, prefix_cache.py).

Two replicas holding the same tokens spent memory on them twice (the fleet's duplicated tokens) and a prefill of
tokens another replica held is routing waste. Kept per (group, content) as blocks come and go: O(replicas) per block,
never a walk of the index.
"""

from __future__ import annotations

from .blocks import Block


class ContentHolders:
    """The blocks by the tokens they hold (`by_content`) and the tokens held twice (`_twice`); PrefixCache sets them."""

    # (group, content) -> the one Block that holds those tokens (most: no map and list per block), else per origin
    # the blocks holding them; holders() gives the map either way
    by_content: dict[tuple[int, int], Block | dict[str, list[Block]]]
    _twice: dict[str, int]  # per origin, tokens it holds that another origin holds too

    def holders(self, group: int, content: int) -> dict[str, list[Block]]:
        """The held blocks (any origin) whose tokens from the prompt's start equal those `content` stands for."""
        found = self.by_content.get((group, content)) if content else None
        if found is None:
            return {}
        return {found.origin: [found]} if isinstance(found, Block) else found

    def duplicated(self) -> dict[str, int]:
        """Per origin, the tokens it holds that another origin holds too (memory spent more than once)."""
        return {origin: tokens for origin, tokens in self._twice.items() if tokens}

    def _count_twice(self, blocks, sign: int) -> None:
        for block in blocks:
            self._twice[block.origin] = self._twice.get(block.origin, 0) + sign * len(block.tokens)

    def _hold_content(self, block: Block) -> None:
        key = (block.group, block.content)
        holders = self.by_content.get(key)
        if holders is None:  # the first to hold them: by this block alone
            self.by_content[key] = block
            return
        if isinstance(holders, Block):  # a second block: the map of every holder, by origin
            holders = self.by_content[key] = {holders.origin: [holders]}
        if len(holders) >= 2 or (holders and block.origin not in holders):  # another origin holds them: spent twice
            self._count_twice((block,), 1)
            if len(holders) == 1:  # ... and so, from now, are the blocks of the one origin that held them alone
                self._count_twice(next(iter(holders.values())), 1)
        holders.setdefault(block.origin, []).append(block)

    def _release_content(self, block: Block) -> None:
        holders = self.by_content.get((block.group, block.content))
        if isinstance(holders, Block):
            if holders is block:
                del self.by_content[(block.group, block.content)]
            return
        mine = holders.get(block.origin) if holders is not None else None
        if holders is None or mine is None:
            return
        try:
            mine.remove(block)
        except ValueError:
            return
        several = len(holders) >= 2
        if not mine:
            del holders[block.origin]
        if several:
            self._count_twice((block,), -1)
            if len(holders) == 1:  # the origin left holds them alone again
                self._count_twice(next(iter(holders.values())), -1)
        if not holders:
            del self.by_content[(block.group, block.content)]

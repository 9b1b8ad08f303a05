"""How blocks leave a server's prefix cache (a mixin of PrefixCache, prefix_cache.py): removed (BlockRemoved, from
each medium that held them), cleared (AllBlocksCleared), gone with a publisher that restarted, or let go past
`max_blocks` (the server still holds them). What a removal leaves behind is kept, bounded, for the rules: when and
how each block went (churn, the evicted cause) and the first tokens of removed roots (prefix-under-block).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

from .blocks import Block, Gone, OriginStats, first_token
from .content_holders import ContentHolders
from .kv_events import BlocksRemoved
from .media import HashOnlyMedia, medium_word, remove_medium
from .requests import RequestLog

GONE_ROOTS = 4096  # first tokens (per origin and group) whose removed root blocks are remembered (prefix-under-block)


class Removals(ContentHolders, HashOnlyMedia):
    """Taking blocks out of the index; PrefixCache sets the state below and defines `stats`."""

    tops: dict[int, list[Block]]
    requests: RequestLog
    let_go: int
    stats: Callable[[str], OriginStats]
    _by_first: dict[tuple[str, int, str | None, int], Block | list[Block]]
    _removed_at: OrderedDict[tuple[str, int, str], Gone]
    _gone_roots: OrderedDict[tuple[str, int, int], deque]

    def _remove(self, event: BlocksRemoved, origin: str, stats: OriginStats, ts: float) -> None:
        groups = (event.group,) if event.group is not None else tuple(sorted(stats.groups)) or (0,)
        word = medium_word(event.medium)
        for key in event.hashes:
            for group in groups:
                block = self.blocks.get((origin, group, key))
                if block is not None:
                    if (
                        block.media is not None
                        or (word is not None and block.medium and word != medium_word(block.medium))
                    ) and not remove_medium(block, word, stats):
                        break  # another medium holds it still (or this one never did): not evicted
                    self._drop(block)
                    stats.removed += 1
                    stats.held -= 1
                    self._removed_at[(origin, group, key)] = Gone(ts, block.stored_ts, block.hits, "evicted")
                    self._remember_root(block, ts)
                    break
            else:
                if self._elsewhere and self._remove_hash(origin, groups, key, word):
                    continue
                stats.unknown_removed += 1
                if stats.let_go:  # most likely one kvtui let go: the server no longer holds it
                    stats.let_go -= 1
                    stats.held -= 1
        while len(self._removed_at) > self.max_blocks:
            self._removed_at.popitem(last=False)

    def _clear(self, origin: str, stats: OriginStats, ts: float) -> None:
        stats.cleared += 1
        for ident in [i for i in self.blocks if i[0] == origin]:
            if ident in self.blocks:
                block = self.blocks[ident]
                self._drop(block)
                self._removed_at[ident] = Gone(ts, block.stored_ts, block.hits, "cleared")
                self._remember_root(block, ts)
        for ident in [i for i in self._elsewhere if i[0] == origin]:
            del self._elsewhere[ident]
        while len(self._removed_at) > self.max_blocks:
            self._removed_at.popitem(last=False)
        stats.held = stats.let_go = 0
        self.requests.forget(origin)

    def restart(self, origin: str) -> int:
        """The origin's publisher restarted (a new process): the blocks the old one held are gone with it. They leave
        the view and `held`, are counted in `gone`, and its sequence is followed anew; the count gone."""
        stats = self.stats(origin)
        gone = stats.held
        for ident in [i for i in self.blocks if i[0] == origin]:
            self._drop(self.blocks[ident])
        for ident in [i for i in self._removed_at if i[0] == origin]:  # a new process's stores are not churn
            del self._removed_at[ident]
        for ident in [i for i in self._elsewhere if i[0] == origin]:
            del self._elsewhere[ident]
        self.requests.forget(origin)
        stats.restarts += 1
        stats.gone += gone
        stats.held = stats.let_go = 0
        stats.last_seq = -1
        return gone

    def _drop(self, block: Block, indexed: bool = True) -> None:
        """Forget one block; its children stay as the tops of its chain (orphans: their parent went). `indexed`
        False: the caller has taken it out of self.blocks already."""
        if indexed:
            del self.blocks[(block.origin, block.group, block.key)]
        all_tops, chain = self.tops, block.chain
        tops = all_tops.get(chain)
        if block.parent is not None:
            block.parent.children.remove(block)
        elif tops is not None:
            try:  # (found by identity: Block compares so)
                tops.remove(block)
            except ValueError:
                pass
        if block.children:
            if tops is None:
                tops = all_tops[chain] = []
            for child in block.children:
                child.parent, child.orphan = None, True
                tops.append(child)
        if tops is not None and not tops:
            del all_tops[chain]
        if block.content:
            self._release_content(block)
        siblings = self._by_first.get(block.sibling_key)
        if siblings is block:
            del self._by_first[block.sibling_key]
        elif type(siblings) is list:
            try:
                siblings.remove(block)
            except ValueError:
                return
            if not siblings:
                del self._by_first[block.sibling_key]

    def _let_go_oldest(self) -> None:
        blocks, limit = self.blocks, self.max_blocks
        while len(blocks) > limit:
            block = blocks.popitem(last=False)[1]  # the oldest
            self._drop(block, indexed=False)
            self.let_go += 1
            self.stats(block.origin).let_go += 1  # still held by the server: `held` keeps counting it

    def _remember_root(self, block: Block, ts: float) -> None:
        """A removed block from a prompt's start: its first tokens, for prefix-under-block (bounded: GONE_ROOTS
        first tokens, the newest few roots each)."""
        if block.orphan or block.depth or not block.content:
            return
        key = (block.origin, block.group, first_token(block.tokens))
        roots = self._gone_roots.get(key)
        if roots is None:
            roots = self._gone_roots[key] = deque(maxlen=4)
            if len(self._gone_roots) > GONE_ROOTS:
                self._gone_roots.popitem(last=False)
        roots.append((block.origin, block.chain, block.tokens, ts))

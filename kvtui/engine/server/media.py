"""Where a server holds a block: its storage media (vLLM's `medium`: GPU, then the CPU or disk tiers an offloading
connector copies to), for prefix_cache.py.

A block is held until every medium that stored it removed it; a store on a faster tier of a block held only on slower
ones brought it back (offloaded-prefix, rules.py). The functions keep one block's media; `HashOnlyMedia`, a mixin of
PrefixCache, keeps the hashes that stores naming hashes only put in a medium where kvtui holds no block for them.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from .blocks import Block, OriginStats
from .kv_events import BlocksStored

if TYPE_CHECKING:
    from .rules import ServerRules

KNOWN_MEDIA = frozenset({"GPU", "CPU", "DISK", "STORAGE"})  # the `medium` words vLLM / SGLang / LMCache send
# media by tier, fastest first: a block stored on a faster tier while held only on slower ones came back from them
# (a medium kvtui does not know, or None where a server names none, counts as GPU's tier when None, else as a slow one)
TIERS = {None: 0, "GPU": 0, "CPU": 1, "DISK": 2, "STORAGE": 2}


def add_medium(block: Block, word: str | None, stats: OriginStats) -> tuple | None:
    """A store in medium `word` of a block held already: the slower media it was held in only, where this store
    put it on a faster one (it came back from them); else None."""
    media = block.media
    if media is None:
        media = block.media = {medium_word(block.medium): 1}
    count = media.get(word)
    if count is not None:
        if TIERS.get(word, 2):
            media[word] = count + 1  # an offload tier announces a hash once per chunk that holds it: counted
        else:
            stats.stored_again += 1
        return None
    came = tuple(media)
    back = faster(word, media)
    media[word] = 1
    if back:
        block.medium = word
        return came
    return None


def remove_medium(block: Block, word: str | None, stats: OriginStats) -> bool:
    """A removal from medium `word` (None: the server names none: its fastest) of a block held: whether no medium
    holds it now (drop it). A removal from a medium kvtui never saw it stored in is counted, not applied."""
    media = block.media
    if media is None:
        if block.medium is None:  # its store named no medium: the server does not tell media apart
            return True
        media = block.media = {medium_word(block.medium): 1}
    if word not in media:
        if word is not None:
            stats.unknown_removed += 1
            return False
        word = min(media, key=lambda m: TIERS.get(m, 2))
    count = media[word] - 1
    if count > 0 and TIERS.get(word, 2):
        media[word] = count
        return False
    del media[word]
    if not media:
        return True
    stats.kept_elsewhere += 1
    block.medium = min(media, key=lambda m: TIERS.get(m, 2))  # where it is held now
    return False


def faster(word: str | None, media) -> bool:
    """Whether medium `word` is a faster tier than every one of `media`."""
    return TIERS.get(word, 2) < min((TIERS.get(m, 2) for m in media), default=0)


def medium_word(medium: str | None) -> str | None:
    """A medium as kvtui compares it (servers differ in case: "cpu", "CPU")."""
    return medium.upper() if medium else None


class HashOnlyMedia:
    """The hashes held in a medium by name only (`_elsewhere`); PrefixCache sets the state below."""

    blocks: OrderedDict[tuple[str, int, str], Block]
    max_blocks: int
    rules: ServerRules
    _elsewhere: OrderedDict[tuple[str, int, str], dict[str | None, int]]

    def _store_hashes(self, event: BlocksStored, origin: str, stats: OriginStats) -> None:
        """A store naming hashes only, or a copy on a slower tier: the held blocks are held in its medium too; other
        hashes are remembered as held there, by hash only (a later store of their tokens on a faster medium came
        back from it). O(its hashes)."""
        word = medium_word(event.medium)
        for key in event.hashes:
            ident = (origin, event.group, key)
            block = self.blocks.get(ident)
            if block is not None:
                add_medium(block, word, stats)
                continue
            media = self._elsewhere.get(ident)
            if media is None:
                media = self._elsewhere[ident] = {}
                if len(self._elsewhere) > self.max_blocks:
                    self._elsewhere.popitem(last=False)
            media[word] = media.get(word, 0) + 1

    def _remove_hash(self, origin: str, groups: tuple, key: str, word: str | None) -> bool:
        """A removal of a hash held only as a store of hashes: whether it was one."""
        for group in groups:
            media = self._elsewhere.get((origin, group, key))
            if media is not None:
                at = word if word in media else next(iter(media))
                media[at] -= 1
                if media[at] <= 0:
                    del media[at]
                if not media:
                    del self._elsewhere[(origin, group, key)]
                return True
        return False

    def _say_back(self, event, origin: str, stats: OriginStats, back: list[Block], came: set, notes: list) -> None:
        """offloaded-prefix for one store whose `back` blocks were held in slower media only (`came`): counted, and
        the rule's note (rules.py)."""
        stats.offloaded_back += len(back)
        first = back[0]
        position = first.start if first.content else None
        tokens = sum(len(block.tokens) for block in back)
        media = sorted(m or "an unnamed medium" for m in came)
        self.rules.offloaded(origin, medium_word(event.medium), tokens, position, first, media, notes)

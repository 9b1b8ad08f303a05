"""The rules judged on a server's prefix cache as its events arrive (codes in records/codes.py, one per cause):

- `recomputed-prefix` (warning): a new chain shares its first tokens with a cached chain and then differs, and the
  cached text goes on after the difference: the tokens after it were prefilled again (where, what, how many).
- `template-drift`: the same, where what differs is only what a chat template renders (reading/prefixes.py's
  judgement, the one every producer uses).
- `varying-start`: prompts that leave the same cached chain at the same token with different text there, over and
  over (a timestamp or request id before shared text makes every request miss).
- `cache-churn`: blocks removed and stored again soon after: the cache is too small for the traffic.

Each note is a Diagnostic whose `where` names the origin, the chain, the position and the block; a flood is bounded
by the same FloodGate as every alarm list (records/diagnostic_groups.py). Cost per new chain: O(its tokens +
SIBLINGS_CHECKED siblings); never O(blocks held).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..reading.prefixes import common_prefix, only_template_differs
from ..reading.token_texts import TokenTexts
from ..records.snapshot import Diagnostic, Where
from .kv_events import BlocksStored

Block = Any  # prefix_cache.Block (that module imports this one)
OriginStats = Any  # prefix_cache.OriginStats


class ChainIndex(Protocol):
    """What the rules read of the index (prefix_cache.PrefixCache)."""

    texts: TokenTexts
    batches: int

    def siblings(self, origin: str, group: int, parent: Any, first: int) -> list[Any] | None: ...

    def origin_words(self, origin: str) -> str: ...


SIBLINGS_CHECKED = 16  # cached chains compared per new chain: those sharing its first token, newest first
CHURN_WINDOW_S = 60.0  # a block stored again within this time of its removal counts as churn
CHURN_MIN = 8  # re-stores before the churn note
INSERT_PROBE = 6  # cached tokens looked for after the difference (text put before shared text)
INSERT_SEARCH = 64  # ... within this many tokens of it
VARYING_MIN = 2  # distinct texts at one cached chain's token before the varying-start note


@dataclass
class _Miss:
    """Prompts that left one cached chain at one token (varying-start's count)."""

    texts: set[str] = field(default_factory=set)
    prompts: int = 0
    noted: bool = False


class ServerRules:
    """The rules' memory across batches (varying-start's misses, the churn count noted) over one PrefixCache."""

    def __init__(self, cache: ChainIndex):
        self.cache = cache
        self._misses: dict[tuple[str, int, int], _Miss] = {}
        self._churn_noted = 0

    def check_churn(self, origin: str, stats: OriginStats, notes: list[Diagnostic]) -> None:
        if stats.restored >= CHURN_MIN and stats.restored >= 2 * self._churn_noted:
            self._churn_noted = max(CHURN_MIN, stats.restored)
            notes.append(
                Diagnostic(
                    "cache-churn",
                    "warning",
                    f"{stats.restored} blocks were stored again within {CHURN_WINDOW_S:.0f} s of being "
                    f"removed{self.cache.origin_words(origin)}: the cache is too small for the traffic (more KV cache "
                    "space, or fewer concurrent prompts)",
                    self.cache.batches,
                    Where(origin=origin),
                )
            )

    def check_left_chain(
        self, event: BlocksStored, index: int, parent: Block | None, tokens: array, origin: str, notes: list
    ) -> None:
        """The first new block of a chain: did a cached sibling (same parent) start with the same tokens, and does
        the cached text go on after the difference (so what follows was prefilled again)? A prompt that simply
        says something else from there on is no waste, and no note."""
        if not len(tokens):
            return
        cache, texts = self.cache, self.cache.texts
        siblings = cache.siblings(origin, event.group, parent, int(tokens[0]))
        if not siblings:
            return
        best, common = None, 0
        for sibling in siblings[-SIBLINGS_CHECKED:]:  # the oldest of equals wins: the chain others came from
            shared = common_prefix(sibling.tokens, tokens)
            if shared > common:
                best, common = sibling, shared
                if shared == len(tokens):
                    break
        if best is None or common >= len(tokens):
            return  # same tokens, another hash (a LoRA, a salt): not a prompt difference
        new_run = array("l", event.token_ids[index * event.block_size :])  # this chain's tokens from the block on
        cached_run = _continuation(best, common + 1 + INSERT_SEARCH + INSERT_PROBE)
        code, why, offset = "recomputed-prefix", "", -1
        a0, b0 = int(cached_run[common]), int(new_run[common])
        texts.ensure((a0, b0))
        if a0 in texts.special or b0 in texts.special or not texts.piece(a0).strip() or not texts.piece(b0).strip():
            texts.ensure([*cached_run[common:], *new_run[common:]])  # the judgement reads the texts from there on
        if only_template_differs(cached_run[common:], new_run[common:], texts.special, texts.piece):
            code = "template-drift"
            why = " (only the chat template's tokens differ: render every request's template the same way)"
        else:
            offset = _realigned(cached_run, new_run, common)
            if offset < 1:
                return  # the cached text does not go on: another prompt, not a miss
            why = self._inserted(new_run, common, offset)
        start = parent.depth + 1 if parent is not None else 0
        position = start * event.block_size + common
        new_id, old_id = int(tokens[common]), int(best.tokens[common])
        prefilled = len(new_run) - common
        where = f"the prompt left cached chain #{best.chain}{cache.origin_words(origin)} at token {position}"
        message = (
            f"{where}: {texts.label(new_id)} instead of {texts.label(old_id)}; {prefilled} tokens after it "
            f"were prefilled again{why}"
        )
        block = event.hashes[index]
        notes.append(Diagnostic(code, "warning", message, cache.batches, Where(origin, best.chain, position, block)))
        if offset >= 1:
            self._count_varying(best, position, new_run, common, offset, origin, notes)

    def _inserted(self, tokens: array, common: int, offset: int) -> str:
        """What was put before the cached text (a timestamp, an id), where it goes on `offset` tokens later."""
        if offset < 2:
            return ""  # one token in place of another (named already)
        inserted = self.cache.texts.text(tokens[common : common + offset - 1]).strip()
        return f" ({inserted!r} was put before the cached text, which follows {offset - 1} tokens later)"

    def _count_varying(self, cached: Block, position: int, tokens: array, common: int, offset: int, origin, notes):
        miss = self._misses.setdefault((origin, cached.chain, position), _Miss())
        miss.prompts += 1
        differing = offset - 1 if offset >= 2 else 1  # what was put there, or the one token in place of another
        texts = self.cache.texts
        miss.texts.add(texts.text(tokens[common : common + differing]).strip())
        if len(miss.texts) >= VARYING_MIN and not miss.noted:
            miss.noted = True
            cached_text = texts.text(cached.tokens[common : common + 1])
            examples = f"{cached_text!r} cached; " + ", ".join(repr(t) for t in sorted(miss.texts)[:3])
            notes.append(
                Diagnostic(
                    "varying-start",
                    "warning",
                    f"{miss.prompts} prompts left cached chain #{cached.chain} at token {position}, each with "
                    f"other text there ({examples}): text that differs per request (a timestamp, a request id) "
                    "before shared text makes every request miss the cache; move it after the shared part",
                    self.cache.batches,
                    Where(origin, cached.chain, position),
                )
            )


def _continuation(block: Block, length: int) -> array:
    """A block's tokens and those of its newest descendants after it, up to `length` (what the cache holds on)."""
    out = array("l", block.tokens)
    while len(out) < length and block.children:
        block = block.children[-1]
        out.extend(block.tokens)
    return out


def _realigned(cached: array, tokens: array, common: int) -> int:
    """The offset from `common` at which `tokens` go on with the cached tokens that follow the differing one
    (1: one token replaced another; k: k - 1 tokens were put in), or -1 where they do not."""
    probe = list(cached[common + 1 : common + 1 + INSERT_PROBE])
    if len(probe) < INSERT_PROBE:
        return -1  # the cache holds too little after it to tell
    window = list(tokens[common : common + INSERT_SEARCH + INSERT_PROBE])
    for start in range(1, len(window) - INSERT_PROBE + 1):
        if window[start : start + INSERT_PROBE] == probe:
            return start
    return -1

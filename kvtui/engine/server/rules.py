"""The rules judged on a server's prefix cache as its events arrive (codes in records/codes.py, one per cause):

Every new chain (a prefill the server announced: the first new block of a BlockStored) gets at most one miss
cause, the first of these that holds; a prompt whose tokens were simply never seen raises nothing.

- `offloaded-prefix` (info): a store on a faster medium (GPU) of blocks the server's events say it held only in
  slower ones (CPU, disk: an offloading connector's tiers), checked before the causes below: they were not lost
  (an offloading connector loads them back rather than prefill them); which media, how many tokens. A removal from
  one medium of a block another still holds is no eviction (prefix_cache.py), so `evicted-prefix` never names it.
- `evicted-prefix` (info): the very block (same hash, same origin) was held before and removed (evicted, or the
  cache cleared): when, at what age, after how many later prefills continued it (inferred: a hit stores nothing).
- `hash-mismatch` (warning): the same origin holds the same tokens from the prompt's start under another hash
  (another LoRA, other extra keys: multimodal ids, a cache salt; which one differs where the event says).
- `held-elsewhere` (warning): another origin (another server of the fleet, or another data-parallel rank) held
  these tokens from the prompt's start at that moment: it was routed to a replica that did not (which one; how
  many tokens were prefilled again).
- `recomputed-prefix` (warning): a new chain shares its first tokens with a cached chain and then differs, and the
  cached text goes on after the difference: the tokens after it were prefilled again (where, what, how many). The
  edit may be a token in place of another, text put in, left out or replaced by text of another length: found
  where the cached text goes on within REALIGN_SEARCH tokens of the difference on either side, for at least
  REALIGN_MIN tokens (INSERT_PROBE for a one-token swap or a pure insertion: reading/edits.py, the one rule a
  watched batching server's requests are judged by too); a difference at a block boundary is looked for among the
  chains cached under the same parent block.
- `template-drift`: the same, where what differs is only what a chat template renders (reading/prefixes.py's
  judgement, the one every producer uses).
- `varying-start`: prompts that leave the same cached chain at the same token with different text there, over and
  over (a timestamp or request id before shared text makes every request miss).
- `cache-churn`: blocks removed and stored again soon after: the cache is too small for the traffic.
- `prefix-under-block` (info): a new chain from the prompt's start (nothing of it was found cached) whose first tokens
  a chain from a prompt's start held (any origin) or removed lately starts with too, at least UNDER_BLOCK_MIN of them
  but fewer than one block (the fewest tokens a store of that origin and group held: a server that also stores
  partial blocks matches those): no block could match (reading/edits.py's judgement, a batching server's too).
  Counted per origin: one note, then one per doubling.

Each note is a Diagnostic whose `where` names the origin, the chain, the position and the block; a flood is bounded
by the same FloodGate as every alarm list (records/diagnostic_groups.py). Cost per new chain: O(its tokens +
SIBLINGS_CHECKED siblings); never O(blocks held).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..reading.edits import (
    REALIGN_LENGTH,
    UNDER_BLOCK_MIN,
    differing_tokens,
    edit_words,
    realigned,
    under_block_words,
    under_one_block,
)
from ..reading.prefixes import common_prefix, longest_prefix, only_template_differs
from ..reading.token_texts import TokenTexts
from ..records.diagnostic_groups import FloodGate
from ..records.snapshot import Diagnostic, Where
from .blocks import Block, OriginStats
from .kv_events import BlocksStored


class ChainIndex(Protocol):
    """What the rules read of the index (prefix_cache.PrefixCache)."""

    texts: TokenTexts
    batches: int
    gate: FloodGate

    def siblings(self, origin: str, group: int, parent: Any, first: int) -> list[Any] | None: ...

    def children(self, parent: Any) -> list[Any]: ...

    def holders(self, group: int, content: int) -> dict[str, list[Any]]: ...

    def origin_words(self, origin: str) -> str: ...

    def roots_starting(self, group: int, first: int) -> list[Any]: ...


SIBLINGS_CHECKED = 16  # cached chains compared per new chain: those sharing its first token, newest first
CHURN_WINDOW_S = 60.0  # a block stored again within this time of its removal counts as churn
CHURN_MIN = 8  # re-stores before the churn note
VARYING_MIN = 2  # distinct texts at one cached chain's token before the varying-start note
MISSES_KEPT = 4096  # places (origin, chain, token) where prompts left a cached chain, remembered for varying-start


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
        # (an OrderedDict: the oldest is let go in O(1); a dict's first key after many deletions is found by a scan)
        self._misses: OrderedDict[tuple[str, int, int], _Miss] = OrderedDict()
        self._churn_noted = 0
        self.hybrid: set[str] = set()  # origins that stored blocks of a Mamba group (their blocks match its state)
        self._under: dict[str, list[int]] = {}  # per origin: prefix-under-block prompts, the count at the last note
        self._under_last: tuple = ()  # the last one judged (a hybrid prefill stores one chain per group, one batch)
        self._noted_last: tuple = ()  # the last chain a miss note was raised on: (origin, batch, position, content)
        self.unit: dict[tuple[str, int], int] = {}  # per (origin, group), the fewest tokens a store's blocks held: a
        # vLLM 0.32 hybrid server with a finer `prefix_match_unit` also stores partial blocks, and matches them

    def offloaded(
        self, origin: str, medium: str | None, tokens: int, position: int | None, first: Block, came: list, notes: list
    ) -> None:
        """offloaded-prefix: `tokens` from `position` stored on `medium` that the server held only in `came`."""
        at = f"from token {position}" if position is not None else f"of chain #{first.chain}"
        where = " and ".join(came)
        notes.append(
            Diagnostic(
                "offloaded-prefix",
                "info",
                f"{tokens} tokens {at}{self.cache.origin_words(origin)} were stored on {medium or 'the first tier'} "
                f"while the server held them on {where} only (offloaded there, as its events say): not a block the "
                f"server had lost (an offloading connector loads them back from {where} rather than prefill them); "
                "its first-tier cache had let them go",
                self.cache.batches,
                Where(origin, first.chain, position or 0, first.key),
            )
        )

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

    def classify_miss(
        self,
        event: BlocksStored,
        index: int,
        parent: Block | None,
        tokens: array,
        origin: str,
        content: int,
        gone: Any,
        ts: float,
        notes: list,
        ids: array | None = None,
    ) -> None:
        """The first new block of a chain: why the server prefilled it (one cause, or none for unseen tokens).
        `ids`: the event's token ids as an array, where the caller has made one (the chain's tokens are sliced from
        it). A hybrid model's prefill stores one chain per KV cache group in one batch, the same tokens at the same
        place: once one of them is noted, the others are the same miss and are not noted again."""
        start = parent.depth + 1 if parent is not None else 0
        judged = (origin, self.cache.batches, start * event.block_size, content)  # content: the tokens, not the hash
        if content and judged == self._noted_last:
            return
        before = len(notes)
        self._classify(event, index, parent, tokens, origin, content, gone, ts, notes, ids)
        if len(notes) > before:
            self._noted_last = judged

    def _classify(
        self,
        event: BlocksStored,
        index: int,
        parent: Block | None,
        tokens: array,
        origin: str,
        content: int,
        gone: Any,
        ts: float,
        notes: list,
        ids: array | None,
    ) -> None:
        size = event.block_size
        start = parent.depth + 1 if parent is not None else 0
        position = start * size
        prefilled = (len(event.hashes) - index) * size
        block = event.hashes[index]
        cache = self.cache
        if gone is not None:
            ago, age = max(0.0, ts - gone.removed_ts), max(0.0, gone.removed_ts - gone.stored_ts)
            why = "evicted" if gone.how == "evicted" else "removed when the cache was cleared"
            notes.append(
                Diagnostic(
                    "evicted-prefix",
                    "info",
                    f"{prefilled} tokens from token {position}{cache.origin_words(origin)} were prefilled again: the "
                    f"server held them and they were {why} {ago:.1f} s before, {age:.1f} s after being stored, "
                    f"continued by {gone.hits} later prefill(s) (inferred from the events)",
                    cache.batches,
                    Where(origin, 0, position, block),
                )
            )
            return
        holders = cache.holders(event.group, content)
        here = holders.get(origin)
        if here:
            other = here[0]
            notes.append(
                Diagnostic(
                    "hash-mismatch",
                    "warning",
                    f"the prompt's first {position + size} tokens{cache.origin_words(origin)} are held already under "
                    f"another hash (chain #{other.chain}): {self._key_differs(other, event, index)}; "
                    f"{prefilled} tokens were prefilled again",
                    cache.batches,
                    Where(origin, other.chain, position, block),
                )
            )
            return
        elsewhere = next((blocks for name, blocks in holders.items() if name != origin), None) if holders else None
        if elsewhere:
            other = elsewhere[0]
            held = self._held_run(event, index, content, other.origin)
            notes.append(
                Diagnostic(
                    "held-elsewhere",
                    "warning",
                    f"{held} tokens from token {position} were prefilled on {origin or 'this server'} while "
                    f"{other.origin} held them (chain #{other.chain} there, stored {max(0.0, ts - other.stored_ts):.1f}"
                    " s before): the request went to a replica without its prefix",
                    cache.batches,
                    Where(origin, other.chain, position, block),
                )
            )
            return
        before = len(notes)
        self.check_left_chain(event, index, parent, tokens, origin, notes, ids)
        if len(notes) == before and parent is None and event.parent is None:
            self.check_under_block(event, tokens, origin, ts, notes)

    def check_under_block(self, event: BlocksStored, tokens: array, origin: str, ts: float, notes: list) -> None:
        """A new chain from the prompt's start: did a chain from a prompt's start (held on any origin, or removed
        lately) begin with the same tokens, fewer than one block of them? Then no block could match. O(origins *
        SIBLINGS_CHECKED + remembered roots) blocks' first tokens."""
        size = min(event.block_size, self.unit.get((origin, event.group), event.block_size))
        if size <= UNDER_BLOCK_MIN or not len(tokens):
            return
        best, shared = None, 0
        for root in self.cache.roots_starting(event.group, int(tokens[0])):
            same = common_prefix(root[2], tokens)
            if same > shared:
                best, shared = root, same
        if best is None or not under_one_block(shared, size):
            return
        other, chain, _, removed_ts = best
        judged = (origin, self.cache.batches, shared)
        if judged == self._under_last:
            return  # the same prefill's chain in another cache group
        self._under_last = judged
        counts = self._under.setdefault(origin, [0, 0])
        counts[0] += 1
        if counts[0] < 2 * counts[1]:
            return
        counts[1] = counts[0]
        held = "held" if removed_ts is None else f"removed {max(0.0, ts - removed_ts):.1f} s before"
        on = f" on {other}" if other != origin else ""
        why = ""
        if origin in self.hybrid:
            why = " (blocks this large are a hybrid model's: its attention block is sized to the Mamba state's page)"
        notes.append(
            Diagnostic(
                "prefix-under-block",
                "info",
                f"the prompt{self.cache.origin_words(origin)} starts as cached chain #{chain}{on} ({held}) does and "
                f"{under_block_words(shared, size, counts[0])}{why}",
                self.cache.batches,
                Where(origin, chain, shared, event.hashes[0]),
            )
        )

    @staticmethod
    def _key_differs(held: Block, event: BlocksStored, index: int) -> str:
        extra = event.extra[index] if index < len(event.extra) else ""
        if held.lora != event.lora:
            return f"the LoRA differs ({held.lora or 'none'} held, {event.lora or 'none'} now)"
        if held.extra != extra:
            return f"the extra keys differ ({held.extra or 'none'} held, {extra or 'none'} now)"
        return "the event names no key that differs (a cache salt or hash seed it does not carry)"

    def _held_run(self, event: BlocksStored, index: int, content: int, other: str) -> int:
        """Tokens from the first new block on that `other` held too (the event's blocks, in order)."""
        size, run = event.block_size, 0
        for i in range(index, len(event.hashes)):
            if i > index:
                content = chain_content(content, array("l", event.token_ids[i * size : (i + 1) * size]))
            if other not in self.cache.holders(event.group, content):
                break
            run += size
        return run

    def check_left_chain(
        self,
        event: BlocksStored,
        index: int,
        parent: Block | None,
        tokens: array,
        origin: str,
        notes: list,
        ids: array | None = None,
    ) -> None:
        """The first new block of a chain: did a cached sibling (same parent) start with the same tokens, and does
        the cached text go on after the difference (so what follows was prefilled again)? A prompt that simply
        says something else from there on is no waste, and no note."""
        if not len(tokens):
            return
        cache, texts = self.cache, self.cache.texts
        start_at = index * event.block_size
        # this chain's tokens from the block on (a slice of the event's array where one was made: C, no int objects)
        new_run = ids[start_at:] if ids is not None else array("l", event.token_ids[start_at:])
        siblings = cache.siblings(origin, event.group, parent, int(tokens[0]))
        best, common = None, 0
        if siblings:  # the oldest of equals wins: the chain others came from
            checked = siblings[-SIBLINGS_CHECKED:]
            found, common = longest_prefix([sibling.tokens for sibling in checked], tokens)
            best = checked[found] if found >= 0 else None
        if best is not None and common >= len(tokens):
            return  # same tokens, another hash (hash-mismatch where kvtui knows the prompt's start)
        edit = None
        if best is None:  # the difference is at the block's first token: the chains cached under the same parent
            for child in cache.children(parent)[-SIBLINGS_CHECKED:]:
                edit = realigned(_continuation(child, REALIGN_LENGTH), new_run, 0)
                if edit is not None:
                    best = child
                    break
            if best is None:
                return
        cached_run = _continuation(best, common + REALIGN_LENGTH)
        code, why = "recomputed-prefix", ""
        a0, b0 = int(cached_run[common]), int(new_run[common])
        texts.ensure((a0, b0))
        # a special token or whitespace at the difference: the only case only_template_differs reads further
        template_like = (
            a0 in texts.special or b0 in texts.special or not texts.piece(a0).strip() or not texts.piece(b0).strip()
        )
        if template_like:
            texts.ensure([*cached_run[common:], *new_run[common:]])  # the judgement reads the texts from there on
        if (
            edit is None
            and template_like
            and only_template_differs(cached_run[common:], new_run[common:], texts.special, texts.piece)
        ):
            code = "template-drift"
            why = " (only the chat template's tokens differ: render every request's template the same way)"
        else:
            edit = edit or realigned(cached_run, new_run, common)
            if edit is None:
                return  # the cached text does not go on: another prompt, not a miss
        start = parent.depth + 1 if parent is not None else 0
        position = start * event.block_size + common
        message = ""  # a note the flood gate will only count is never read: its words are not built
        if self._listed(code, notes):
            if edit is not None and code == "recomputed-prefix":
                why = edit_words(cached_run, new_run, common, edit, texts.text)
            new_id, old_id = int(tokens[common]), int(best.tokens[common])
            prefilled = len(new_run) - common
            where = f"the prompt left cached chain #{best.chain}{cache.origin_words(origin)} at token {position}"
            message = (
                f"{where}: {texts.label(new_id)} instead of {texts.label(old_id)}; {prefilled} tokens after it "
                f"were prefilled again{why}"
            )
        block = event.hashes[index]
        notes.append(Diagnostic(code, "warning", message, cache.batches, Where(origin, best.chain, position, block)))
        if edit is not None:
            self._count_varying(best, position, new_run, common, differing_tokens(edit), origin, notes)

    def _listed(self, code: str, notes: list[Diagnostic]) -> bool:
        """Whether the cache's flood gate will list a note of `code` added to `notes` now (the batch's notes, admitted
        in order when it is applied) rather than only count it. The texts are not asked for pieces in the words
        skipped: `ensure` above learned what the judgement reads (a lazy TokenTexts would learn less)."""
        gate = self.cache.gate
        count = gate.counts.get(code, 0) + 1 + sum(1 for note in notes if note.code == code)
        return gate.would_list(count)

    def _count_varying(self, cached: Block, position: int, tokens: array, common: int, put: int, origin, notes):
        key = (origin, cached.chain, position)
        miss = self._misses.get(key)
        if miss is None:
            if len(self._misses) >= MISSES_KEPT:  # a long watch: the oldest place forgotten, memory stays bounded
                self._misses.popitem(last=False)
            miss = self._misses[key] = _Miss()
        miss.prompts += 1
        if miss.noted:
            return  # said once; its texts are no longer needed
        differing = put or 1  # what was put there, or the one token in place of another
        texts = self.cache.texts
        miss.texts.add(texts.text(tokens[common : common + differing]).strip())
        if len(miss.texts) >= VARYING_MIN:
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


def chain_content(previous: int, tokens: array) -> int:
    """kvtui's hash of a prompt's tokens through one more block, whatever hash the server uses (never 0: 0 is
    "its start unknown"); `previous` is that of the tokens before it (1 at the prompt's start)."""
    return hash((previous, tokens.tobytes())) or 1

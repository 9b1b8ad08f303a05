"""The records of a server's prefix cache (prefix_cache.py): a block held, a block gone, and one publisher's counts.

Kept apart from PrefixCache so that the modules reading them (view.py, rules.py, metric_rules.py) need not import the
index that fills them.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

HIT_DEPTH = 256  # blocks up a chain a continuation is counted as a hit on (the cost of one store stays bounded)


@dataclass(slots=True, eq=False)
class Block:
    """One block the server holds (kvtui's object, mutable: its children grow)."""

    key: str  # its hash, as kv_events.block_key writes it
    origin: str
    parent: Block | None
    tokens: array  # array('l'): this block's token ids
    group: int
    medium: str | None
    chain: int  # the number of its chain (its root's)
    depth: int  # its index in the chain (blocks before it); a block whose parent kvtui never saw starts at 0
    stored_batch: int
    stored_ts: float
    children: list[Block] = field(default_factory=list)
    orphan: bool = False  # its parent was announced before kvtui attached, or let go
    sibling_key: tuple = ()  # where PrefixCache indexes it among its siblings (origin, group, parent, 1st id)
    content: int = 0  # kvtui's hash of the tokens from the prompt's start through this block (0: its start unknown)
    hits: int = 0  # later prefills that went on from this block or one after it where another already had (inferred:
    # a hit stores nothing; a store after a leaf is taken for the same request decoding on, so this is a floor)
    lora: str | None = None
    extra: str = ""  # the extra keys its hash covers, as the event says
    noted: bool = False  # stored by a prefill a miss cause was noted on (its continuation raises none again)
    media: dict[str | None, int] | None = None  # where it is held, by medium word (upper case) -> stores there (an
    # offload tier's stores are reference counted, as vLLM asks; a first-tier store again is `stored_again`); None:
    # held in `medium` only (most blocks: no dict)

    @property
    def start(self) -> int:
        """The position of its first token in the prompt (where its depth is known)."""
        return self.depth * len(self.tokens)


@dataclass(slots=True)
class Gone:
    """A block the server removed or cleared: what the evicted cause reads when its tokens come back."""

    removed_ts: float
    stored_ts: float
    hits: int
    how: str  # "evicted" (BlockRemoved) or "cleared" (AllBlocksCleared)


@dataclass
class OriginStats:
    """Per publisher (a server, or one data-parallel rank of it)."""

    batches: int = 0
    events: int = 0
    stored: int = 0  # blocks stored
    removed: int = 0  # blocks removed (by BlockRemoved)
    cleared: int = 0  # AllBlocksCleared events
    held: int = 0  # blocks held now
    last_seq: int = -1
    lost: int = 0  # batches missing from the sequence (not recovered by replay)
    skipped: int = 0  # events of unknown types
    unknown_removed: int = 0  # removals of blocks kvtui never saw stored (attached late, or let go)
    let_go: int = 0  # blocks let go past max_blocks that the server may still hold (counted in `held`)
    restored: int = 0  # blocks stored again within CHURN_WINDOW_S of their removal
    capacity: int | None = None  # blocks the server can hold (its metrics), where known
    restarts: int = 0  # times its publisher came back as a new one (a new epoch: the sequence starts anew)
    gone: int = 0  # blocks it held when it restarted: gone with the old process, no longer counted in `held`
    caught_up: int = 0  # batches given by the replay socket when kvtui attached (before it watched)
    stored_again: int = 0  # blocks stored while held already (a hash stored again without a removal between)
    unknown_medium: int = 0  # blocks stored with a `medium` that is not GPU / CPU / DISK / STORAGE / none
    kept_elsewhere: int = 0  # blocks removed from one medium while another still held them (offloaded: not evicted)
    offloaded_back: int = 0  # blocks stored on a faster medium while held only on slower ones (offloaded-prefix)
    routed_tokens: int = 0  # tokens prefilled here while another replica held them (routing waste)
    live_tokens: int = 0  # tokens in the blocks its live batches announced stored (stored again included; not a
    # report's re-announced blocks, a hit; not what the replay socket gave on attach): what metric_rules cross-checks
    block_size: int = 0  # tokens per block, as its events say
    requests: int = 0  # prefills seen (requests.py's rows: a request that stored or reported blocks)
    reports: int = 0  # requests whose reused blocks the server reported (kv_cache_report_mode full)
    reported_hits: int = 0  # tokens found cached, as those reports say
    inferred_hits: int = 0  # tokens found cached, inferred from the chains of the prefills not reported
    groups: set[int] = field(default_factory=set)  # the cache groups it stored blocks in (where a removal that
    # names no group, as SGLang's, is looked for: O(groups), not a walk of every block)


def count_hit(block: Block) -> None:
    """A prefill continued `block`: it and the blocks before it (up to HIT_DEPTH) were hits."""
    steps = 0
    node: Block | None = block
    while node is not None and steps < HIT_DEPTH:
        node.hits += 1
        node = node.parent
        steps += 1


def first_token(tokens: array) -> int:
    return int(tokens[0]) if len(tokens) else -1

"""A server's prefix cache as its KV events tell it: the block index (chains, blocks held, per-publisher counts).

`PrefixCache.apply(batch, origin)` folds one published EventBatch in and returns the notes its rules raised
(rules.py; Diagnostics with a `where`). Every number comes from the events: a block is held from its BlockStored to
its BlockRemoved (or AllBlocksCleared); a chain is a root block and everything stored under it. Where the server's
blocks outnumber `max_blocks`, the oldest are let go and counted, so memory stays bounded at any event rate. The
metrics over time are metrics.py's, the text report report.py's.

A block may be held in several media at once (vLLM's `medium`: GPU, then CPU or disk tiers where an offloading
connector copies it): it is held until every medium that stored it removed it, so a removal from the GPU of a block
a CPU tier still holds is no eviction (`kept_elsewhere`), and a prefill that stores on the GPU blocks held only in a
slower medium is `offloaded-prefix` (rules.py), not a miss. Stores that name hashes only (vLLM's offloading events
without their `self_describing_kv_events` option: block_size 0, no tokens) say which medium holds a hash.

Cost per event: O(blocks in it + siblings sharing its first token, capped); never O(blocks held).
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace

from ..reading.token_texts import TokenTexts
from ..records.diagnostic_groups import FloodGate
from ..records.snapshot import Diagnostic
from .fleet import FleetSeries
from .kv_events import AllCleared, BlocksRemoved, BlocksStored, EventBatch
from .metric_rules import MetricRules
from .metrics import METRICS_KEPT, MetricSample, add_sample
from .requests import RequestLog
from .rules import CHURN_WINDOW_S, SIBLINGS_CHECKED, ServerRules, chain_content

CAUGHT_UP = "(caught up: before kvtui attached)"  # the start of a note on a batch the replay socket gave on attach
KNOWN_MEDIA = frozenset({"GPU", "CPU", "DISK", "STORAGE"})  # the `medium` words vLLM / SGLang / LMCache send
MAX_BLOCKS = 200_000  # blocks kept (per view); the oldest beyond it are let go and counted
# media by tier, fastest first: a block stored on a faster tier while held only on slower ones came back from them
# (a medium kvtui does not know, or None where a server names none, counts as GPU's tier when None, else as a slow one)
TIERS = {None: 0, "GPU": 0, "CPU": 1, "DISK": 2, "STORAGE": 2}
GONE_ROOTS = 4096  # first tokens (per origin and group) whose removed root blocks are remembered (prefix-under-block)


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


class PrefixCache:
    """What the events of one or several publishers (origins) say their prefix caches hold."""

    def __init__(self, texts: TokenTexts | None = None, max_blocks: int = MAX_BLOCKS):
        self.texts = texts or TokenTexts()
        self.max_blocks = max_blocks
        self.lock = threading.Lock()  # the reader applies, view.py reads frames (read_frame), each under it
        self.blocks: OrderedDict[tuple[str, int, str], Block] = OrderedDict()  # oldest first: who is let go
        self.tops: dict[int, list[Block]] = {}  # chain number -> its top blocks: its root, or the orphans it left
        self.origins: dict[str, OriginStats] = {}
        self.notes: list[Diagnostic] = []  # bounded by the gate: FLOOD_LISTED per code, then one per doubling
        self.gate = FloodGate()
        self.rules = ServerRules(self)
        self.metric_rules = MetricRules()
        self.batches = 0
        self.let_go = 0  # blocks dropped past max_blocks (still held by the server: not "removed")
        self.chains = 0
        # (origin, group, parent, 1st id) -> the blocks there: one Block where it is the only one (most: no list per
        # block), else a list (siblings() gives a list either way)
        self._by_first: dict[tuple[str, int, str | None, int], Block | list[Block]] = {}
        self._removed_at: OrderedDict[tuple[str, int, str], Gone] = OrderedDict()  # for churn and the evicted cause
        # (group, content) -> per origin, the blocks holding those tokens from the prompt's start (O(1) to ask whether
        # another origin holds them, however many hashes one origin holds them under)
        # where one block alone holds them (most), the Block itself (no map and list per block); holders() gives the map
        self.by_content: dict[tuple[int, int], Block | dict[str, list[Block]]] = {}
        self._twice: dict[str, int] = {}  # per origin, tokens it holds that another origin holds too (kept as blocks
        # come and go: O(replicas) per block, never a walk of the index)
        self.metrics: dict[str, deque[MetricSample]] = {}  # per server, the newest METRICS_KEPT samples
        self.requests = RequestLog()  # each prefill as one request's row: its hits and its misses
        self.fleet = FleetSeries()  # routing waste and tokens held twice, per origin, over time
        self._elsewhere: OrderedDict[tuple[str, int, str], dict[str | None, int]] = OrderedDict()  # hashes that
        # stores naming hashes only (no tokens) put in a medium, where kvtui holds no block for them
        self._first_tier: dict[str, int] = {}  # per origin, the fastest tier it stored tokens on (where it prefills)
        self._gone_roots: OrderedDict[tuple[str, int, int], deque] = OrderedDict()  # (origin, group, 1st id) ->
        # the newest root blocks removed: (origin, chain, tokens, removed ts), for prefix-under-block

    def record_metrics(self, origin: str, ts: float, metrics, notes: list[Diagnostic] | None = None) -> MetricSample:
        """A poll of the server's /metrics (server_http.CacheMetrics): the hit rate over time comes from here
        (a prefix hit stores nothing, so events alone cannot tell it), and the metric rules judge it beside the
        events (metric_rules.py); the notes they raise are kept as every note is, and added to `notes`."""
        sample = add_sample(self.metrics.setdefault(origin, deque(maxlen=METRICS_KEPT)), ts, metrics)
        raised = self.metric_rules.judge(origin, metrics, self.origins, self.batches)
        admitted = [shown for note in raised if (shown := self.gate.admit(note)) is not None]
        self.notes.extend(admitted)
        if notes is not None:
            notes.extend(admitted)
        if metrics.capacity is not None:
            for name, stats in self.origins.items():
                if name == origin or name.startswith(origin + "/"):
                    stats.capacity = metrics.capacity
            self.stats(origin).capacity = metrics.capacity
        return sample

    # ---- applying events ------------------------------------------------------------------------------

    def stats(self, origin: str) -> OriginStats:
        found = self.origins.get(origin)
        if found is None:
            found = self.origins[origin] = OriginStats()
        return found

    @property
    def note_counts(self) -> dict[str, int]:
        """Every note raised, by code (listed or not)."""
        return self.gate.counts

    def apply(self, batch: EventBatch, origin: str = "") -> list[Diagnostic]:
        """Fold one batch in; the notes it raised (also appended to self.notes). Call under self.lock when a
        view may be read at the same time."""
        self.batches += 1
        stats = self.stats(origin)
        if (stats.last_seq >= 0 or stats.restarts) and batch.seq > stats.last_seq + 1:  # a restart's start at 0
            stats.lost += batch.seq - stats.last_seq - 1
        stats.last_seq = max(stats.last_seq, batch.seq)
        stats.batches += 1
        stats.events += len(batch.events) + batch.skipped
        stats.skipped += batch.skipped
        notes: list[Diagnostic] = []
        for event in batch.events:
            if isinstance(event, BlocksStored):
                reported = self._store(event, origin, stats, batch.ts, notes)
                stats.block_size = event.block_size or stats.block_size
                # the first tier's stores (an offload tier's copies are no prefill): what /metrics counts. A report's
                # re-announced blocks are that request's hit, not tokens stored (its row counts them so too)
                if (
                    not reported
                    and not batch.caught_up
                    and TIERS.get(_word(event.medium), 2) <= self._first_tier.get(origin, 3)
                ):
                    stats.live_tokens += len(event.hashes) * event.block_size
            elif isinstance(event, BlocksRemoved):
                self._remove(event, origin, stats, batch.ts)
            elif isinstance(event, AllCleared):
                self._clear(origin, stats, batch.ts)
        self._let_go_oldest()
        if self.fleet.due(batch.ts):
            self.fleet.add(batch.ts, {name: s.routed_tokens for name, s in self.origins.items()}, self._twice)
        if batch.caught_up:  # said as what it is: a prefill before kvtui attached, not a new one
            stats.caught_up += 1
            notes = [replace(n, message=f"{CAUGHT_UP} {n.message}") for n in notes]
        notes = [shown for note in notes if (shown := self.gate.admit(note)) is not None]
        self.notes.extend(notes)
        return notes

    def count_lost(self, origin: str, batches: int) -> None:
        """Batches the subscriber knows it missed and could not replay."""
        self.stats(origin).lost += batches

    def _store(self, event: BlocksStored, origin: str, stats: OriginStats, ts: float, notes: list) -> bool:
        """Fold one store in; True when it was a report of a request's reused blocks (kv_cache_report_mode full),
        which stores nothing."""
        size = event.block_size
        stats.groups.add(event.group)
        if event.medium is not None and event.medium.upper() not in KNOWN_MEDIA:
            stats.unknown_medium += len(event.hashes)
        if event.kind == "mamba":
            self.rules.hybrid.add(origin)
        tier = TIERS.get(_word(event.medium), 2)
        first = self._first_tier.get(origin, 3)
        if size and tier < first:
            self._first_tier[origin] = first = tier
        if not size or tier > first:  # hashes only, or a copy on a slower tier than this origin prefills on (an
            self._store_hashes(event, origin)  # offload: no prefill): which medium holds them
            return False
        units = self.rules.unit
        if size < units.get((origin, event.group), size + 1):
            units[(origin, event.group)] = size
        if (
            event.parent is None
            and event.hashes
            and (origin, event.group, event.hashes[0]) in self.blocks  # (a fresh prefill stops here: one lookup)
            and self._reuse_report(event, origin, stats, ts)
        ):
            return True
        parent = self.blocks.get((origin, event.group, event.parent)) if event.parent is not None else None
        count, token_ids = len(event.hashes) * size, event.token_ids
        self.texts.ensure(token_ids if len(token_ids) == count else token_ids[:count])  # (a copy only where needed)
        ids = event.ids  # once per event (the decoder's, or made here): each block's tokens are a slice of it (C)
        if ids is None:
            ids = array("l", event.token_ids)
        first_new = True
        continuing = noted = False
        row = None
        new_blocks = 0
        blocks, group, by_content, removed_at = self.blocks, event.group, self.by_content, self._removed_at
        elsewhere_held = self._elsewhere
        tops, by_first, batches, medium, lora = self.tops, self._by_first, self.batches, event.medium, event.lora
        extras = len(event.extra)
        word = _word(event.medium)
        back: list[Block] = []  # blocks held only in slower media that this store put on a faster one (came back)
        back_from: set[str | None] = set()  # the media they came back from
        at = 0  # where this block's tokens start in `ids`
        for index, key in enumerate(event.hashes):
            tokens = ids[at : at + size]
            at += size
            ident = (origin, group, key)
            held = blocks.get(ident)
            if held is not None:  # stored again without a removal kvtui saw: nothing new (counted), or another medium
                parent = held
                if held.media is None and _word(held.medium) == word:
                    stats.stored_again += 1
                else:
                    came = self._add_medium(held, word, stats)
                    if came:
                        back.append(held)
                        back_from.update(came)
                continue
            elsewhere = elsewhere_held.pop(ident, None) if elsewhere_held else None
            gone = removed_at.pop(ident, None) if removed_at else None
            came_back = elsewhere is not None and _faster(word, elsewhere)
            if elsewhere is not None:  # a medium held it (its store named the hash only): not evicted
                gone = None
            if gone is not None and gone.how == "evicted" and ts - gone.removed_ts <= CHURN_WINDOW_S:
                stats.restored += 1
            if parent is None:
                orphan = index == 0 and event.parent is not None  # its parent came before kvtui
                # (the start unknown: an orphan, or a block after one kvtui let go within this store)
                content = 0 if orphan or index > 0 else chain_content(1, tokens)
            else:
                orphan = False
                content = chain_content(parent.content, tokens) if parent.content else 0
            if first_new:
                first_new = False
                # blocks stored after a leaf a miss was noted on: that request decoding on (or its next turn), not
                # another prefill: no second note, and generated tokens are no routing waste
                continuing = parent is not None and parent.noted and not parent.children
                where = (origin, event.group, parent.key) if parent is not None else None
                row = self.requests.going_on(origin, event.group, event.session, where)
                reported = row is not None and row.reported and not row.new  # the report counted its hit
                if parent is not None and parent.children and not reported:
                    _count_hit(parent)  # another prompt went on from here before: this one reused it (a hit)
                before = len(notes)
                if back or came_back:
                    noted = True  # offloaded-prefix, said once the store's blocks are all counted
                elif not continuing:
                    self.rules.classify_miss(event, index, parent, tokens, origin, content, gone, ts, notes, ids)
                    noted = len(notes) > before
                if row is None:
                    row = self._prefill_row(event, origin, stats, parent, ts)
                if noted and row.cause is None:
                    row.cause = notes[before].code if len(notes) > before else "offloaded-prefix"
            holders = by_content.get((group, content)) if content else None
            if (
                holders is not None
                and not continuing
                and (
                    holders.origin != origin
                    if isinstance(holders, Block)
                    else len(holders) > 1 or origin not in holders
                )
            ):
                stats.routed_tokens += len(tokens)  # another replica held these very tokens: routing waste
            extra = event.extra[index] if index < extras else ""
            # the block, built here rather than in a helper (a call per block, and its index key built twice)
            sibling_key = (origin, group, parent.key if parent is not None else None, tokens[0] if tokens else -1)
            if parent is None:
                self.chains += 1
                block = Block(
                    key, origin, None, tokens, group, medium, self.chains, 0, batches, ts, [], orphan, sibling_key,
                    content, 0, lora, extra, noted or continuing,
                )  # fmt: skip
                tops.setdefault(self.chains, []).append(block)
            else:
                block = Block(
                    key, origin, parent, tokens, group, medium, parent.chain, parent.depth + 1, batches, ts, [], False,
                    sibling_key, content, 0, lora, extra, noted or continuing,
                )  # fmt: skip
                parent.children.append(block)
            blocks[ident] = block
            siblings = by_first.get(sibling_key)
            if siblings is None:
                by_first[sibling_key] = block
            elif isinstance(siblings, Block):
                by_first[sibling_key] = [siblings, block]
            else:
                siblings.append(block)
            if elsewhere is not None:
                block.media = {word: 1, **{m: n for m, n in elsewhere.items() if m != word}}
                if came_back:
                    back.append(block)
                    back_from.update(elsewhere)
            if content:
                if holders is None:  # the first to hold these tokens (most blocks): held by this block alone
                    by_content[(group, content)] = block
                else:
                    self._hold_content(block)
            parent = block
            new_blocks += 1
        stats.stored += new_blocks
        stats.held += new_blocks
        if row is None and back and parent is not None:  # every block came back from a slower tier: still a request
            where = (origin, event.group, event.parent) if event.parent is not None else None
            row = self.requests.going_on(origin, event.group, event.session, where)
            if row is None:
                row = self._prefill_row(event, origin, stats, parent, ts)  # its hit: through the last block back
                row.cause = "offloaded-prefix"
        if back and not continuing:
            self._say_back(event, origin, stats, back, back_from, notes)
        if row is not None and parent is not None:  # the request's row: its new blocks, the last where it goes on
            row.new += new_blocks * size
            row.last = (origin, event.group, parent.key)
            row.chain = row.chain or parent.chain
        self.rules.check_churn(origin, stats, notes)
        return False

    def _reuse_report(self, event: BlocksStored, origin: str, stats: OriginStats, ts: float) -> bool:
        """vLLM's report of a request's reused blocks (its client sent kv_cache_report_mode full): a store from the
        prompt's first block whose blocks are all held here already, in chain order. Read as that request's hits
        (a row, the blocks' hit counts), not as blocks stored again; whether it was one. O(its blocks)."""
        held: list[Block] = []
        word = _word(event.medium)
        for key in event.hashes:
            block = self.blocks.get((origin, event.group, key))
            if block is None or (held and block.parent is not held[-1]):
                return False
            if (block.media is None and _word(block.medium) != word) or (block.media and word not in block.media):
                return False  # held in another medium only: brought back (offloaded-prefix), not a report
            held.append(block)
        if not held:
            return False
        tokens = sum(len(block.tokens) for block in held)
        stats.requests += 1
        stats.reports += 1
        stats.reported_hits += tokens
        last = held[-1]
        _count_hit(last)
        ident = (origin, event.group, last.key)
        self.requests.reported(origin, event.group, event.session, tokens, ident, last.chain, ts)
        return True

    def _prefill_row(self, event: BlocksStored, origin: str, stats: OriginStats, parent: Block | None, ts: float):
        """A new request's row, its hits inferred from its chain: the tokens of the held blocks before its first new
        one (unknown where the chain's start is: it began before kvtui attached, or was let go)."""
        if parent is None:
            hit = 0 if event.parent is None else None
        else:
            hit = parent.start + len(parent.tokens) if parent.content else None
        stats.requests += 1
        stats.inferred_hits += hit or 0
        return self.requests.prefill(origin, event.group, event.session, hit, 0, ts)

    def _remove(self, event: BlocksRemoved, origin: str, stats: OriginStats, ts: float) -> None:
        groups = (event.group,) if event.group is not None else tuple(sorted(stats.groups)) or (0,)
        word = _word(event.medium)
        for key in event.hashes:
            for group in groups:
                block = self.blocks.get((origin, group, key))
                if block is not None:
                    if (
                        block.media is not None or (word is not None and block.medium and word != _word(block.medium))
                    ) and not self._remove_medium(block, word, stats):
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

    def siblings(self, origin: str, group: int, parent: Block | None, first: int) -> list[Block] | None:
        """The held blocks under `parent` whose first token is `first`, oldest first (None: none)."""
        found = self._by_first.get((origin, group, parent.key if parent else None, first))
        return [found] if isinstance(found, Block) else found

    def children(self, parent: Block | None) -> list[Block]:
        """The held blocks stored right after `parent` (a miss at a block boundary is looked for among them)."""
        return parent.children if parent is not None else []

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

    def origin_words(self, origin: str) -> str:
        return f" on {origin}" if origin and len(self.origins) > 1 else ""

    def roots_starting(self, group: int, first: int) -> list[tuple]:
        """The chains from a prompt's start whose first token is `first`, held on any origin (the newest
        SIBLINGS_CHECKED of each) or removed lately: (origin, chain, tokens of its first block, removed ts or None).
        O(origins + those)."""
        found: list[tuple] = []
        for origin in self.origins:
            for block in (self.siblings(origin, group, None, first) or ())[-SIBLINGS_CHECKED:]:
                if not block.orphan and block.depth == 0:
                    found.append((origin, block.chain, block.tokens, None))
        for origin in self.origins:
            found.extend(self._gone_roots.get((origin, group, first), ()))
        return found

    def _remember_root(self, block: Block, ts: float) -> None:
        """A removed block from a prompt's start: its first tokens, for prefix-under-block (bounded: GONE_ROOTS
        first tokens, the newest few roots each)."""
        if block.orphan or block.depth or not block.content:
            return
        key = (block.origin, block.group, _first(block.tokens))
        roots = self._gone_roots.get(key)
        if roots is None:
            roots = self._gone_roots[key] = deque(maxlen=4)
            if len(self._gone_roots) > GONE_ROOTS:
                self._gone_roots.popitem(last=False)
        roots.append((block.origin, block.chain, block.tokens, ts))

    # ---- media -----------------------------------------------------------------------------------------

    @staticmethod
    def _add_medium(block: Block, word: str | None, stats: OriginStats) -> tuple | None:
        """A store in medium `word` of a block held already: the slower media it was held in only, where this store
        put it on a faster one (it came back from them); else None."""
        media = block.media
        if media is None:
            media = block.media = {_word(block.medium): 1}
        count = media.get(word)
        if count is not None:
            if TIERS.get(word, 2):
                media[word] = count + 1  # an offload tier announces a hash once per chunk that holds it: counted
            else:
                stats.stored_again += 1
            return None
        came = tuple(media)
        back = _faster(word, media)
        media[word] = 1
        if back:
            block.medium = word
            return came
        return None

    @staticmethod
    def _remove_medium(block: Block, word: str | None, stats: OriginStats) -> bool:
        """A removal from medium `word` (None: the server names none: its fastest) of a block held: whether no medium
        holds it now (drop it). A removal from a medium kvtui never saw it stored in is counted, not applied."""
        media = block.media
        if media is None:
            if block.medium is None:  # its store named no medium: the server does not tell media apart
                return True
            media = block.media = {_word(block.medium): 1}
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

    def _store_hashes(self, event: BlocksStored, origin: str) -> None:
        """A store naming hashes only, or a copy on a slower tier: the held blocks are held in its medium too; other
        hashes are remembered as held there, by hash only (a later store of their tokens on a faster medium came
        back from it). O(its hashes)."""
        word = _word(event.medium)
        stats = self.stats(origin)
        for key in event.hashes:
            ident = (origin, event.group, key)
            block = self.blocks.get(ident)
            if block is not None:
                self._add_medium(block, word, stats)
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
        self.rules.offloaded(origin, _word(event.medium), tokens, position, first, media, notes)

    # ---- reading ---------------------------------------------------------------------------------------

    def chain_blocks(self, chain: int) -> list[Block]:
        """The blocks of one chain, depth first (bounded by the chain's size)."""
        out: list[Block] = []
        stack = list(reversed(self.tops.get(chain, [])))
        while stack:
            block = stack.pop()
            out.append(block)
            stack.extend(reversed(block.children))
        return out

    @property
    def held(self) -> int:
        return len(self.blocks)


HIT_DEPTH = 256  # blocks up a chain a continuation is counted as a hit on (the cost of one store stays bounded)


def _count_hit(block: Block) -> None:
    """A prefill continued `block`: it and the blocks before it (up to HIT_DEPTH) were hits."""
    steps = 0
    node: Block | None = block
    while node is not None and steps < HIT_DEPTH:
        node.hits += 1
        node = node.parent
        steps += 1


def _faster(word: str | None, media) -> bool:
    """Whether medium `word` is a faster tier than every one of `media`."""
    return TIERS.get(word, 2) < min((TIERS.get(m, 2) for m in media), default=0)


def _word(medium: str | None) -> str | None:
    """A medium as kvtui compares it (servers differ in case: "cpu", "CPU")."""
    return medium.upper() if medium else None


def _first(tokens: array) -> int:
    return int(tokens[0]) if len(tokens) else -1

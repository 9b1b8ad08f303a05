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

Here: the index's state, applying a batch and storing blocks. Its parts: the records (blocks.py), a block's media and
the hash-only stores (media.py), which blocks hold the same tokens (content_holders.py), and how blocks leave
(removals.py); PrefixCache inherits the last three's mixins.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict, deque
from dataclasses import replace

from ..reading.token_texts import TokenTexts
from ..records.diagnostic_groups import FloodGate
from ..records.snapshot import Diagnostic
from .blocks import Block, Gone, OriginStats, count_hit
from .fleet import FleetSeries
from .kv_events import AllCleared, BlocksRemoved, BlocksStored, EventBatch
from .media import KNOWN_MEDIA, TIERS, add_medium, faster, medium_word
from .metric_rules import MetricRules
from .metrics import METRICS_KEPT, MetricSample, add_sample
from .removals import Removals
from .requests import RequestLog
from .rules import CHURN_WINDOW_S, SIBLINGS_CHECKED, ServerRules, chain_content

CAUGHT_UP = "(caught up: before kvtui attached)"  # the start of a note on a batch the replay socket gave on attach
MAX_BLOCKS = 200_000  # blocks kept (per view); the oldest beyond it are let go and counted


class PrefixCache(Removals):
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
        raised = self.metric_rules.judge(origin, metrics, self.origins, self.batches, ts)
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
                    and TIERS.get(medium_word(event.medium), 2) <= self._first_tier.get(origin, 3)
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
        tier = TIERS.get(medium_word(event.medium), 2)
        first = self._first_tier.get(origin, 3)
        if size and tier < first:
            self._first_tier[origin] = first = tier
        if not size or tier > first:  # hashes only, or a copy on a slower tier than this origin prefills on (an
            self._store_hashes(event, origin, stats)  # offload: no prefill): which medium holds them
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
        word = medium_word(event.medium)
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
                if held.media is None and medium_word(held.medium) == word:
                    stats.stored_again += 1
                else:
                    came = add_medium(held, word, stats)
                    if came:
                        back.append(held)
                        back_from.update(came)
                continue
            elsewhere = elsewhere_held.pop(ident, None) if elsewhere_held else None
            gone = removed_at.pop(ident, None) if removed_at else None
            came_back = elsewhere is not None and faster(word, elsewhere)
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
                    count_hit(parent)  # another prompt went on from here before: this one reused it (a hit)
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
        word = medium_word(event.medium)
        for key in event.hashes:
            block = self.blocks.get((origin, event.group, key))
            if block is None or (held and block.parent is not held[-1]):
                return False
            if (block.media is None and medium_word(block.medium) != word) or (block.media and word not in block.media):
                return False  # held in another medium only: brought back (offloaded-prefix), not a report
            held.append(block)
        if not held:
            return False
        tokens = sum(len(block.tokens) for block in held)
        stats.requests += 1
        stats.reports += 1
        stats.reported_hits += tokens
        last = held[-1]
        count_hit(last)
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

    def siblings(self, origin: str, group: int, parent: Block | None, first: int) -> list[Block] | None:
        """The held blocks under `parent` whose first token is `first`, oldest first (None: none)."""
        found = self._by_first.get((origin, group, parent.key if parent else None, first))
        return [found] if isinstance(found, Block) else found

    def children(self, parent: Block | None) -> list[Block]:
        """The held blocks stored right after `parent` (a miss at a block boundary is looked for among them)."""
        return parent.children if parent is not None else []

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

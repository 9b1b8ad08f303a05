"""What the server screen draws of a PrefixCache, as frozen values read under `cache.lock` in bounded time.

The reader thread applies events under the same lock; `read_frame`, `read_block_info` and `read_note_target` take
it here (waiting at most `timeout`; None when the reader held it: the next refresh tries again), copy what is shown
and let it go: a widget takes no lock and holds no live Block, index or TokenTexts. Everything is O(what is shown):
the newest MAX_CHAINS chains (plus the ones the user pinned by selecting them), at most MAX_NODES tree nodes, blocks
counted up to COUNT_BUDGET, the newest NOTES_SCANNED notes, the pieces of the tokens shown; never O(blocks held).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from ..records.snapshot import Diagnostic, Where
from .blocks import Block, OriginStats
from .fleet import FleetSample, fleet_sample
from .metrics import MetricSample, watched_rate
from .prefix_cache import PrefixCache
from .requests import RequestFacts

MAX_CHAINS = 200  # chains shown, newest first (chains the user selected are kept on top of these)
MAX_NODES = 2000  # tree nodes at most (chains and blocks)
COUNT_BUDGET = 20_000  # blocks visited per view to count the chains' blocks ("k+ blocks" past it)
NOTES_SCANNED = 500  # newest notes looked at for the notes of one block
TOKENS_SHOWN = 512  # tokens of one block shown in its detail
PREVIEW_TOKENS = 48  # tokens of a block kept for its one-line label in the tree
SPARK_SAMPLES = 120  # newest metric samples plotted
GROUPS_TRIED = 8  # KV cache groups looked in for a note's block (hybrid models have a few)
NOTES_SHOWN = 500  # newest notes handed to the notes pane per frame
REQUESTS_SHOWN = 20  # newest request rows handed to the requests pane per frame

Ident = tuple[str, int, str]  # (origin, group, hash): how PrefixCache keys a block


def ident_of(block: Block | BlockFacts) -> Ident:
    return (block.origin, block.group, block.key)


@dataclass(frozen=True, slots=True)
class NodeRef:
    """What a tree node stands for: a chain (ident None) or one block of it."""

    chain: int
    ident: Ident | None = None


@dataclass(frozen=True, slots=True)
class BlockFacts:
    """One held block as the tree shows it (a copy: the block itself stays in the index)."""

    key: str
    origin: str
    group: int
    chain: int
    depth: int
    start: int  # the position of its first token
    medium: str | None
    tokens: tuple[int, ...]  # its first PREVIEW_TOKENS tokens

    @classmethod
    def of(cls, block: Block) -> BlockFacts:
        tokens = tuple(block.tokens[:PREVIEW_TOKENS])
        return cls(block.key, block.origin, block.group, block.chain, block.depth, block.start, block.medium, tokens)


@dataclass(frozen=True, slots=True)
class BlockRow:
    block: BlockFacts
    container: Ident | None  # the block whose node holds this one (None: the chain's node)


@dataclass(frozen=True, slots=True)
class ChainRow:
    chain: int
    top: BlockFacts  # its first top block (its root, or the first orphan left when the root went)
    blocks: int  # its blocks, counted (a lower bound where `exact` is False)
    exact: bool
    expanded: bool
    rows: tuple[BlockRow, ...]  # its blocks in the tree (only for expanded chains)
    hidden: int  # blocks of an expanded chain past the node budget
    replicas: tuple[str, ...] = ()  # the other origins holding its first block's tokens from the prompt's start


@dataclass(frozen=True, slots=True)
class CacheView:
    chains: tuple[ChainRow, ...]  # newest first
    total_chains: int
    held: int
    chains_hidden: int
    blocks_hidden: int  # blocks held in chains not shown, and cut from expanded chains by the node budget

    @property
    def nodes(self) -> int:
        return len(self.chains) + sum(len(c.rows) for c in self.chains)


@dataclass(frozen=True, slots=True)
class TextsView:
    """The pieces of the tokens a frame shows (copied from the TokenTexts), and the special ids."""

    pieces: Mapping[int, str]  # a read-only copy
    special: frozenset[int]

    def piece(self, token_id: int) -> str:
        return self.pieces.get(token_id, f"#{token_id}")

    def __reduce__(self):  # a frame crosses a pipe (reader_process.py): a mapping proxy does not pickle
        return (_texts_view, (dict(self.pieces), self.special))


def _texts_view(pieces: dict[int, str], special: frozenset[int]) -> TextsView:
    return TextsView(MappingProxyType(pieces), special)


def build_view(
    cache: PrefixCache,
    expanded: set[int] | frozenset[int] = frozenset(),
    pinned: Iterable[int] = (),
    max_chains: int = MAX_CHAINS,
    max_nodes: int = MAX_NODES,
) -> CacheView:
    """The tree's content (call under cache.lock). O(max_chains + max_nodes + COUNT_BUDGET)."""
    tops = cache.tops
    pins = {c for c in pinned if c in tops}
    chosen = sorted(pins.union(itertools.islice(reversed(tops), max_chains)), reverse=True)
    budget = max(0, max_nodes - len(chosen))
    counted = COUNT_BUDGET
    # pinned chains take their blocks from the node budget first, then the newest
    order = sorted(chosen, key=lambda c: (c not in pins, -c))
    rows_of: dict[int, ChainRow] = {}
    for chain in order:
        chain_tops = tops[chain]
        rows: list[BlockRow] = []
        hidden = 0
        if chain in expanded:
            rows, rest = _rows(chain_tops, budget)
            budget -= len(rows)
            extra, exact = _count(rest, max(counted, 1))
            counted -= extra
            hidden = extra
            count = len(rows) + extra
        else:
            count, exact = _count([(b, None) for b in chain_tops], max(counted, 1))
            counted -= count
        top = BlockFacts.of(chain_tops[0])
        first = chain_tops[0]
        replicas = tuple(sorted(set(cache.holders(first.group, first.content)) - {first.origin}))
        rows_of[chain] = ChainRow(chain, top, count, exact, chain in expanded, tuple(rows), hidden, replicas)
    chains = tuple(rows_of[c] for c in chosen)
    in_shown = sum(c.blocks for c in chains)  # (a lower bound where a count stopped at COUNT_BUDGET)
    cut = sum(c.hidden for c in chains)
    return CacheView(chains, len(tops), cache.held, len(tops) - len(chains), max(0, cache.held - in_shown) + cut)


def _rows(tops: list[Block], budget: int) -> tuple[list[BlockRow], list[tuple[Block, Ident | None]]]:
    """A chain's blocks in tree order, up to `budget`; and what is left to walk. A run of single children
    stays in one container; the children of a block with several are nested under it, each holding its
    own run (a branch)."""
    rows: list[BlockRow] = []
    # (block, where its node goes, where its only child's node goes)
    stack: list[tuple[Block, Ident | None, Ident | None]] = []
    if len(tops) == 1:
        stack.append((tops[0], None, None))
    else:
        stack.extend((top, None, ident_of(top)) for top in reversed(tops))
    while stack:
        if len(rows) >= budget:
            return rows, [(block, None) for block, _, _ in stack]
        block, place, run = stack.pop()
        rows.append(BlockRow(BlockFacts.of(block), place))
        children = block.children
        if len(children) == 1:
            stack.append((children[0], run, run))
        elif children:
            here = ident_of(block)
            stack.extend((child, here, ident_of(child)) for child in reversed(children))
    return rows, []


def _count(start: list[tuple[Block, Ident | None]], budget: int) -> tuple[int, bool]:
    """Blocks at and under `start`, visiting at most `budget` (exact: all were counted)."""
    stack = [block for block, _ in start]
    count = 0
    while stack:
        if count >= budget:
            return count, False
        block = stack.pop()
        count += 1
        stack.extend(block.children)
    return count, True


# ---- one block ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlockInfo:
    key: str
    parent: str | None  # the parent's hash (None: a root; an orphan's parent is gone)
    orphan: bool
    chain: int
    depth: int
    start: int
    end: int
    group: int
    medium: str | None
    origin: str
    stored_batch: int
    children: int
    tokens: tuple[int, ...]  # the first TOKENS_SHOWN
    token_count: int
    notes: tuple[Diagnostic, ...]


def find_block(cache: PrefixCache, ref: NodeRef | None) -> Block | None:
    """The block a tree node stands for (a chain: its first top). Call under cache.lock."""
    if ref is None:
        return None
    if ref.ident is not None:
        return cache.blocks.get(ref.ident)
    tops = cache.tops.get(ref.chain)
    return tops[0] if tops else None


def block_info(cache: PrefixCache, ref: NodeRef | None) -> BlockInfo | None:
    """The detail of the selected block (call under cache.lock): O(block size + NOTES_SCANNED)."""
    block = find_block(cache, ref)
    if block is None:
        return None
    size = len(block.tokens)
    notes = tuple(
        note
        for note in cache.notes[-NOTES_SCANNED:]
        if (where := note.where) is not None
        and ((where.block and where.block == block.key and where.origin == block.origin) or where.chain == block.chain)
    )
    return BlockInfo(
        key=block.key,
        parent=block.parent.key if block.parent is not None else None,
        orphan=block.orphan,
        chain=block.chain,
        depth=block.depth,
        start=block.start,
        end=block.start + size,
        group=block.group,
        medium=block.medium,
        origin=block.origin,
        stored_batch=block.stored_batch,
        children=len(block.children),
        tokens=tuple(block.tokens[:TOKENS_SHOWN]),
        token_count=size,
        notes=notes,
    )


def note_target(cache: PrefixCache, note: Diagnostic) -> NodeRef | None:
    """Where a note points in the tree (call under cache.lock): the block it names while it is held, else
    the chain it names, else None."""
    where = note.where or Where()
    if where.block:
        for group in range(GROUPS_TRIED):
            block = cache.blocks.get((where.origin, group, where.block))
            if block is not None:
                return NodeRef(block.chain, ident_of(block))
    if where.chain and where.chain in cache.tops:
        return NodeRef(where.chain)
    return None


# ---- the server's numbers ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OriginCounts:
    """One publisher's counts at the time of the frame (OriginStats' numbers, frozen)."""

    batches: int
    events: int
    stored: int
    removed: int
    cleared: int
    held: int
    lost: int
    skipped: int
    unknown_removed: int
    let_go: int
    restored: int
    capacity: int | None
    restarts: int
    gone: int
    stored_again: int = 0  # stream integrity: a hash stored while held
    unknown_medium: int = 0  # stream integrity: a `medium` word kvtui does not know
    routed_tokens: int = 0  # tokens prefilled here while another replica held them
    caught_up: int = 0  # batches the replay socket gave on attach
    requests: int = 0  # prefills seen (request rows)
    reports: int = 0  # of them, those whose hits the server reported (kv_cache_report_mode full)
    reported_hits: int = 0
    inferred_hits: int = 0
    kept_elsewhere: int = 0  # blocks removed from one medium while another held them (offloaded, not evicted)
    offloaded_back: int = 0  # blocks stored on a faster medium while held only on slower ones

    @classmethod
    def of(cls, s: OriginStats) -> OriginCounts:
        return cls(
            s.batches,
            s.events,
            s.stored,
            s.removed,
            s.cleared,
            s.held,
            s.lost,
            s.skipped,
            s.unknown_removed,
            s.let_go,
            s.restored,
            s.capacity,
            s.restarts,
            s.gone,
            s.stored_again,
            s.unknown_medium,
            s.routed_tokens,
            s.caught_up,
            s.requests,
            s.reports,
            s.reported_hits,
            s.inferred_hits,
            s.kept_elsewhere,
            s.offloaded_back,
        )


@dataclass(frozen=True, slots=True)
class StatsView:
    origins: tuple[tuple[str, OriginCounts], ...]
    samples: tuple[tuple[str, tuple[MetricSample, ...]], ...]  # per server, the newest SPARK_SAMPLES, oldest first
    batches: int
    events: int
    let_go: int
    held: int
    chains: int
    notes: int
    watched: tuple[tuple[str, float], ...] = ()  # per server, the hit rate over the interval kvtui watched
    twice: tuple[tuple[str, int], ...] = ()  # per origin, tokens held that another origin holds too
    codes: tuple[tuple[str, int], ...] = ()  # every note raised, by code (listed or counted past the flood bound)
    fleet: tuple[FleetSample, ...] = ()  # the newest SPARK_SAMPLES fleet samples, oldest first, and one for now
    requests: tuple[RequestFacts, ...] = ()  # the newest REQUESTS_SHOWN request rows, newest first


def stats_view(cache: PrefixCache) -> StatsView:
    """Call under cache.lock: O(origins + SPARK_SAMPLES)."""
    samples = tuple(
        (origin, tuple(reversed(list(itertools.islice(reversed(kept), SPARK_SAMPLES)))))
        for origin, kept in cache.metrics.items()
    )
    origins = tuple((name, OriginCounts.of(stats)) for name, stats in cache.origins.items())
    twice = cache.duplicated()
    fleet: tuple[FleetSample, ...] = ()
    if len(origins) > 1:  # the samples, then the index as it is now (the plot ends at the present)
        kept = cache.fleet.samples
        now = fleet_sample(kept[-1].ts if kept else 0.0, {name: s.routed_tokens for name, s in origins}, twice)
        fleet = (*reversed(list(itertools.islice(reversed(kept), SPARK_SAMPLES - 1))), now)
    return StatsView(
        origins=origins,
        samples=samples,
        batches=cache.batches,
        events=sum(stats.events for _, stats in origins),
        let_go=cache.let_go,
        held=cache.held,
        chains=len(cache.tops),
        notes=len(cache.notes),
        twice=tuple(twice.items()),
        fleet=fleet,
        requests=cache.requests.newest(REQUESTS_SHOWN),
        codes=tuple(sorted(cache.note_counts.items())),
        watched=tuple(
            (origin, rate[0]) for origin, kept in cache.metrics.items() if (rate := watched_rate(kept)) is not None
        ),
    )


# ---- one frame, read under the lock ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Frame:
    """What one refresh of the server screen shows. `view` and `info` are None when nothing changed since the
    signature handed in (the screen keeps what it drew); `notes`: the notes raised since `notes_from`."""

    signature: tuple
    stats: StatsView
    view: CacheView | None = None
    info: BlockInfo | None = None
    notes: tuple[Diagnostic, ...] = ()
    total_notes: int = 0
    texts: TextsView = field(default_factory=lambda: TextsView(MappingProxyType({}), frozenset()))


def read_frame(
    cache: PrefixCache,
    expanded: Iterable[int],
    pinned: Iterable[int],
    selected: NodeRef | None,
    notes_from: int,
    last: tuple | None,
    timeout: float,
    force: bool = False,
    notes_max: int = NOTES_SHOWN,
) -> Frame | None:
    """Take the lock (at most `timeout`; None: the reader held it), and copy what the screen shows when it
    changed since the frame whose signature is `last` (or `force`)."""
    if not cache.lock.acquire(timeout=timeout):
        return None
    try:
        expanded, pins = frozenset(expanded), frozenset(pinned)
        signature = (
            cache.batches,
            cache.held,
            len(cache.notes),
            sum(len(m) for m in cache.metrics.values()),
            next((m[-1].ts for m in cache.metrics.values() if m), None),
            expanded,
            pins,
            selected,
        )
        stats = stats_view(cache)
        if not force and signature == last:
            return Frame(signature, stats)
        view = build_view(cache, expanded, pins)
        info = block_info(cache, selected)
        total = len(cache.notes)
        notes = tuple(cache.notes[max(notes_from, total - notes_max) : total])
        texts = _texts(cache, view, info)
        return Frame(signature, stats, view, info, notes, total, texts)
    finally:
        cache.lock.release()


def read_block_info(cache: PrefixCache, ref: NodeRef | None, timeout: float) -> tuple[BlockInfo | None, TextsView]:
    """The selected block's detail (raises TimeoutError where the reader held the lock past `timeout`)."""
    if not cache.lock.acquire(timeout=timeout):
        raise TimeoutError("the event reader holds the cache")
    try:
        info = block_info(cache, ref)
        return info, _texts(cache, None, info)
    finally:
        cache.lock.release()


def read_note_target(cache: PrefixCache, note: Diagnostic, timeout: float) -> NodeRef | None:
    """Where a note points now (raises TimeoutError where the reader held the lock past `timeout`)."""
    if not cache.lock.acquire(timeout=timeout):
        raise TimeoutError("the event reader holds the cache")
    try:
        return note_target(cache, note)
    finally:
        cache.lock.release()


def _texts(cache: PrefixCache, view: CacheView | None, info: BlockInfo | None) -> TextsView:
    """The pieces of every token the frame shows: O(tokens shown), a dict get each."""
    ids: set[int] = set()
    if view is not None:
        for chain in view.chains:
            ids.update(chain.top.tokens)
            for row in chain.rows:
                ids.update(row.block.tokens)
    if info is not None:
        ids.update(info.tokens)
    known = cache.texts.pieces
    pieces = {i: known[i] for i in ids if i in known}
    return TextsView(MappingProxyType(pieces), frozenset(cache.texts.special))


class Frames(Protocol):
    """The screen's three reads of what a reader holds, whoever answers them: a PrefixCache in this process
    (CacheFrames) or an AttachSession in a process of its own over a pipe (reader_process.ReaderProcess). One contract,
    checked by mypy on both (`frames_of` below, ReaderProcess.frames); the timeouts are how long the screen waits."""

    def read_frame(
        self,
        expanded: Iterable[int],
        pinned: Iterable[int],
        selected: NodeRef | None,
        notes_from: int,
        last: tuple | None,
        timeout: float,
        force: bool = False,
        notes_max: int = NOTES_SHOWN,
    ) -> Frame | None:
        """What one refresh shows (view and info None where nothing changed since `last`); None: not in time."""
        ...

    def read_block_info(self, ref: NodeRef | None, timeout: float) -> tuple[BlockInfo | None, TextsView]:
        """The selected block's detail (raises TimeoutError where it cannot be read in time)."""
        ...

    def read_note_target(self, note: Diagnostic, timeout: float) -> NodeRef | None:
        """Where a note points now (raises TimeoutError where it cannot be read in time)."""
        ...


class CacheFrames:
    """The screen's reads of a PrefixCache in this process (a replayed trace, a session read on a thread); an
    AttachSession in a process of its own answers the same three calls over a pipe (reader_process.py)."""

    def __init__(self, cache: PrefixCache):
        self.cache = cache

    def read_frame(
        self,
        expanded: Iterable[int],
        pinned: Iterable[int],
        selected: NodeRef | None,
        notes_from: int,
        last: tuple | None,
        timeout: float,
        force: bool = False,
        notes_max: int = NOTES_SHOWN,
    ) -> Frame | None:
        return read_frame(self.cache, expanded, pinned, selected, notes_from, last, timeout, force, notes_max)

    def read_block_info(self, ref: NodeRef | None, timeout: float) -> tuple[BlockInfo | None, TextsView]:
        return read_block_info(self.cache, ref, timeout)

    def read_note_target(self, note: Diagnostic, timeout: float) -> NodeRef | None:
        return read_note_target(self.cache, note, timeout)


def frames_of(cache: PrefixCache) -> Frames:
    """The screen's reads of a cache in this process (typed as the contract: mypy checks CacheFrames keeps it)."""
    return CacheFrames(cache)

"""A server's prefix cache as its KV events tell it: block chains, blocks held, and why a prompt missed them.

`PrefixCache.apply(batch, origin)` folds one published EventBatch in and returns the notes it raised. Every
number comes from the events: a block is held from its BlockStored to its BlockRemoved (or AllBlocksCleared);
a chain is a root block and everything stored under it. Where the server's blocks outnumber `max_blocks`,
the oldest are let go and counted, so memory stays bounded at any event rate.

The rulebook at serving scale (the notes; one per cause):
- `prefix-miss`: a new chain shares its first tokens with a cached chain and then differs: where, what, and
  how many tokens after it were prefilled again.
- `template-drift`: the same, where what differs is only what a chat template renders (special tokens,
  role words, whitespace), the text itself being the same.
- `varying-start`: prompts that leave the same cached chain at the same token with different text there, over
  and over (a timestamp or request id before shared text makes every request miss).
- `cache-churn`: blocks removed and stored again soon after: the cache is too small for the traffic.

Cost per event: O(blocks in it + siblings sharing its first token, capped); never O(blocks held).
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..reading.diagnostics import token_text
from ..records.snapshot import Diagnostic, frozen
from .kv_events import AllCleared, BlocksRemoved, BlocksStored, EventBatch

MAX_BLOCKS = 200_000  # blocks kept (per view); the oldest beyond it are let go and counted
SIBLINGS_CHECKED = 16  # cached chains compared per new chain: those sharing its first token, newest first
CHURN_WINDOW_S = 60.0  # a block stored again within this time of its removal counts as churn
CHURN_MIN = 8  # re-stores before the churn note
INSERT_PROBE = 6  # cached tokens looked for after the difference (text put before shared text)
INSERT_SEARCH = 64  # ... within this many tokens of it
VARYING_MIN = 2  # distinct texts at one cached chain's token before the varying-start note
NOTES_PER_CODE = 20  # notes listed per code before the rest are only counted
METRICS_KEPT = 3600  # metric samples kept per server (an hour at one a second)


@frozen
class CacheNote:
    """A note the prefix cache raised, with where it points (for the panes to select)."""

    code: str
    severity: str
    message: str
    batch: int  # the applied batch that raised it (1-based, over the whole view)
    origin: str = ""
    chain: int = 0  # the cached chain it names (0: none)
    position: int = -1  # the token where the prompt left that chain (-1: none)
    block: str = ""  # the new block that left it

    @property
    def diagnostic(self) -> Diagnostic:
        return Diagnostic(code=self.code, severity=self.severity, message=self.message, step=self.batch)


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

    @property
    def start(self) -> int:
        """The position of its first token in the prompt (where its depth is known)."""
        return self.depth * len(self.tokens)


class TokenTexts:
    """Token ids to display text: what kvtui learned from a tokenizer (local or the server's `/detokenize`),
    remembered, so a trace can carry it and replay needs no tokenizer."""

    def __init__(self, resolve: Callable[[list[int]], dict[int, str]] | None = None, special: Iterable[int] = ()):
        self.pieces: dict[int, str] = {}
        self.special: set[int] = set(special)
        self.fresh: dict[int, str] = {}  # learned since the last take_fresh() (the trace writes them)
        self._resolve = resolve

    def learn(self, pieces: dict[int, str], special: Iterable[int] = ()) -> None:
        self.pieces.update(pieces)
        self.special.update(special)

    def ensure(self, ids: Iterable[int]) -> None:
        if self._resolve is None:
            return
        missing = sorted({i for i in ids if i not in self.pieces})
        if missing:
            found = self._resolve(missing)
            self.pieces.update(found)
            self.fresh.update(found)
            self.special.update(getattr(self._resolve, "special", ()))  # a source that learns them as it goes

    def take_fresh(self) -> dict[int, str]:
        fresh, self.fresh = self.fresh, {}
        return fresh

    def piece(self, token_id: int) -> str:
        return self.pieces.get(token_id, f"#{token_id}")

    def label(self, token_id: int) -> str:
        return token_text(self.piece(token_id), token_id)

    def text(self, ids: Iterable[int]) -> str:
        return "".join(self.piece(i) for i in ids)


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
    groups: set[int] = field(default_factory=set)  # the cache groups it stored blocks in (where a removal that
    # names no group, as SGLang's, is looked for: O(groups), not a walk of every block)


@frozen
class MetricSample:
    """One poll of a server's /metrics: its prefix-cache counters and the hit rate since the poll before."""

    ts: float
    queries: float | None
    hits: float | None
    rate: float | None  # hits / queries over the interval since the previous sample (None: no new queries)
    overall: float | None  # hits / queries since the server started
    capacity: int | None
    usage: float | None


@dataclass
class _Miss:
    """Prompts that left one cached chain at one token (varying-start's count)."""

    texts: set[str] = field(default_factory=set)
    prompts: int = 0
    noted: bool = False


class PrefixCache:
    """What the events of one or several publishers (origins) say their prefix caches hold."""

    def __init__(self, texts: TokenTexts | None = None, max_blocks: int = MAX_BLOCKS):
        self.texts = texts or TokenTexts()
        self.max_blocks = max_blocks
        self.lock = threading.Lock()  # the reader applies, the UI reads views, each under it
        self.blocks: OrderedDict[tuple[str, int, str], Block] = OrderedDict()  # oldest first: who is let go
        self.tops: dict[int, list[Block]] = {}  # chain number -> its top blocks: its root, or the orphans it left
        self.origins: dict[str, OriginStats] = {}
        self.notes: list[CacheNote] = []  # bounded: NOTES_PER_CODE per code, then one per doubling
        self.note_counts: dict[str, int] = {}  # every note raised, by code (listed or not)
        self.batches = 0
        self.let_go = 0  # blocks dropped past max_blocks (still held by the server: not "removed")
        self.chains = 0
        self._by_first: dict[tuple[str, int, str | None, int], list[Block]] = {}  # (origin, group, parent, 1st id)
        self._removed_at: OrderedDict[tuple[str, int, str], float] = OrderedDict()  # for churn
        self._misses: dict[tuple[str, int, int], _Miss] = {}
        self._churn_noted = 0
        self.metrics: dict[str, deque[MetricSample]] = {}  # per server, the newest METRICS_KEPT samples

    def record_metrics(self, origin: str, ts: float, metrics) -> MetricSample:
        """A poll of the server's /metrics (server_http.CacheMetrics): the hit rate over time comes from here
        (a prefix hit stores nothing, so events alone cannot tell it)."""
        samples = self.metrics.setdefault(origin, deque(maxlen=METRICS_KEPT))
        rate = None
        before = samples[-1] if samples else None
        if before is not None and None not in (metrics.queries, metrics.hits, before.queries, before.hits):
            asked = metrics.queries - before.queries
            rate = (metrics.hits - before.hits) / asked if asked > 0 else None
        overall = metrics.hits / metrics.queries if metrics.queries and metrics.hits is not None else None
        sample = MetricSample(ts, metrics.queries, metrics.hits, rate, overall, metrics.capacity, metrics.usage)
        samples.append(sample)
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

    def apply(self, batch: EventBatch, origin: str = "") -> list[CacheNote]:
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
        notes: list[CacheNote] = []
        for event in batch.events:
            if isinstance(event, BlocksStored):
                self._store(event, origin, stats, batch.ts, notes)
            elif isinstance(event, BlocksRemoved):
                self._remove(event, origin, stats, batch.ts)
            elif isinstance(event, AllCleared):
                self._clear(origin, stats)
        self._let_go_oldest()
        notes = [shown for note in notes if (shown := self._admit(note)) is not None]
        self.notes.extend(notes)
        return notes

    def _admit(self, note: CacheNote) -> CacheNote | None:
        """One alarm per cause, and a busy server's flood bounded: past NOTES_PER_CODE notes of one code, the rest
        are counted (note_counts, the summary) and one note in each doubling says how many there were so far."""
        count = self.note_counts[note.code] = self.note_counts.get(note.code, 0) + 1
        if count <= NOTES_PER_CODE:
            return note
        if count & (count - 1) == 0:  # 32, 64, 128 ...: one note that says so
            return CacheNote(
                note.code,
                note.severity,
                f"{count} {note.code} notes so far (only the first {NOTES_PER_CODE} and one per doubling are "
                f"listed); the last: {note.message}",
                note.batch,
                note.origin,
                note.chain,
                note.position,
                note.block,
            )
        return None

    def count_lost(self, origin: str, batches: int) -> None:
        """Batches the subscriber knows it missed and could not replay."""
        self.stats(origin).lost += batches

    def _store(self, event: BlocksStored, origin: str, stats: OriginStats, ts: float, notes: list) -> None:
        size = event.block_size
        stats.groups.add(event.group)
        parent = self.blocks.get((origin, event.group, event.parent)) if event.parent is not None else None
        self.texts.ensure(event.token_ids[: len(event.hashes) * size])
        first_new = True
        for index, key in enumerate(event.hashes):
            tokens = array("l", event.token_ids[index * size : (index + 1) * size])
            ident = (origin, event.group, key)
            if ident in self.blocks:  # stored again without a removal kvtui saw: nothing new
                parent = self.blocks[ident]
                continue
            if first_new:
                self._check_left_chain(event, index, parent, tokens, origin, notes)
                first_new = False
            removed_at = self._removed_at.pop(ident, None)
            if removed_at is not None and ts - removed_at <= CHURN_WINDOW_S:
                stats.restored += 1
            orphan = parent is None and index == 0 and event.parent is not None  # its parent came before kvtui
            block = self._new_block(key, origin, parent, tokens, event, ts, orphan)
            parent = block
            stats.stored += 1
            stats.held += 1
        if stats.restored >= CHURN_MIN and stats.restored >= 2 * self._churn_noted:
            self._churn_noted = max(CHURN_MIN, stats.restored)
            notes.append(
                CacheNote(
                    code="cache-churn",
                    severity="warning",
                    message=f"{stats.restored} blocks were stored again within {CHURN_WINDOW_S:.0f} s of being "
                    f"removed{self._origin_words(origin)}: the cache is too small for the traffic (more KV cache "
                    "space, or fewer concurrent prompts)",
                    batch=self.batches,
                    origin=origin,
                )
            )

    def _new_block(self, key, origin, parent, tokens, event, ts, orphan) -> Block:
        if parent is None:
            self.chains += 1
            chain, depth = self.chains, 0
        else:
            chain, depth = parent.chain, parent.depth + 1
        block = Block(
            key, origin, parent, tokens, event.group, event.medium, chain, depth, self.batches, ts, orphan=orphan
        )
        self.blocks[(origin, event.group, key)] = block
        if parent is None:
            self.tops.setdefault(chain, []).append(block)
        else:
            parent.children.append(block)
        block.sibling_key = (origin, event.group, parent.key if parent else None, _first(tokens))
        self._by_first.setdefault(block.sibling_key, []).append(block)
        return block

    def _check_left_chain(self, event, index, parent, tokens, origin, notes) -> None:
        """The first new block of a chain: did a cached sibling (same parent) start with the same tokens, and does
        the cached text go on after the difference (so what follows was prefilled again)? A prompt that simply
        says something else from there on is no waste, and no note."""
        if not len(tokens):
            return
        siblings = self._by_first.get((origin, event.group, parent.key if parent else None, int(tokens[0])))
        if not siblings:
            return
        best, common = None, 0
        for sibling in siblings[-SIBLINGS_CHECKED:]:  # the oldest of equals wins: the chain others came from
            shared = _common_prefix(sibling.tokens, tokens)
            if shared > common:
                best, common = sibling, shared
                if shared == len(tokens):
                    break
        if best is None or common >= len(tokens):
            return  # same tokens, another hash (a LoRA, a salt): not a prompt difference
        new_run = array("l", event.token_ids[index * event.block_size :])  # this chain's tokens from the block on
        cached_run = _continuation(best, common + 1 + INSERT_SEARCH + INSERT_PROBE)
        code, why = self._classify(cached_run, new_run, common)
        offset = -1
        if code == "prefix-miss":
            offset = _realigned(cached_run, new_run, common)
            if offset < 1:
                return  # the cached text does not go on: another prompt, not a miss
            why = self._inserted(new_run, common, offset)
        start = parent.depth + 1 if parent is not None else 0
        position = start * event.block_size + common
        new_id, old_id = int(tokens[common]), int(best.tokens[common])
        prefilled = len(new_run) - common
        self.texts.ensure((new_id, old_id))
        where = f"the prompt left cached chain #{best.chain}{self._origin_words(origin)} at token {position}"
        message = (
            f"{where}: {self.texts.label(new_id)} instead of {self.texts.label(old_id)}; {prefilled} tokens after it "
            f"were prefilled again{why}"
        )
        block = event.hashes[index]
        notes.append(CacheNote(code, "warning", message, self.batches, origin, best.chain, position, block))
        if offset >= 1:
            self._count_varying(best, position, new_run, common, offset, origin, notes)

    def _classify(self, cached: array, tokens: array, common: int) -> tuple[str, str]:
        """template-drift where the two differ only in special tokens and whitespace from there on."""
        special = self.texts.special
        if int(tokens[common]) in special or int(cached[common]) in special:
            self.texts.ensure([*cached[common:], *tokens[common:]])
            a = self.texts.text(t for t in cached[common:] if t not in special)
            b = self.texts.text(t for t in tokens[common:] if t not in special)
            a, b = "".join(a.split()), "".join(b.split())
            n = min(len(a), len(b))
            if n and a[:n] == b[:n]:
                return "template-drift", (
                    " (only the chat template's tokens differ: render every request's template the same way)"
                )
        return "prefix-miss", ""

    def _inserted(self, tokens: array, common: int, offset: int) -> str:
        """What was put before the cached text (a timestamp, an id), where it goes on `offset` tokens later."""
        if offset < 2:
            return ""  # one token in place of another (named already)
        inserted = self.texts.text(tokens[common : common + offset - 1]).strip()
        return f" ({inserted!r} was put before the cached text, which follows {offset - 1} tokens later)"

    def _count_varying(self, cached: Block, position: int, tokens: array, common: int, offset: int, origin, notes):
        miss = self._misses.setdefault((origin, cached.chain, position), _Miss())
        miss.prompts += 1
        differing = offset - 1 if offset >= 2 else 1  # what was put there, or the one token in place of another
        miss.texts.add(self.texts.text(tokens[common : common + differing]).strip())
        if len(miss.texts) >= VARYING_MIN and not miss.noted:
            miss.noted = True
            cached_text = self.texts.text(cached.tokens[common : common + 1])
            examples = f"{cached_text!r} cached; " + ", ".join(repr(t) for t in sorted(miss.texts)[:3])
            notes.append(
                CacheNote(
                    code="varying-start",
                    severity="warning",
                    message=f"{miss.prompts} prompts left cached chain #{cached.chain} at token {position}, each with "
                    f"other text there ({examples}): text that differs per request (a timestamp, a request id) "
                    "before shared text makes every request miss the cache; move it after the shared part",
                    batch=self.batches,
                    origin=origin,
                    chain=cached.chain,
                    position=position,
                )
            )

    def _remove(self, event: BlocksRemoved, origin: str, stats: OriginStats, ts: float) -> None:
        groups = (event.group,) if event.group is not None else tuple(sorted(stats.groups)) or (0,)
        for key in event.hashes:
            for group in groups:
                block = self.blocks.get((origin, group, key))
                if block is not None:
                    self._drop(block)
                    stats.removed += 1
                    stats.held -= 1
                    self._removed_at[(origin, group, key)] = ts
                    break
            else:
                stats.unknown_removed += 1
                if stats.let_go:  # most likely one kvtui let go: the server no longer holds it
                    stats.let_go -= 1
                    stats.held -= 1
        while len(self._removed_at) > self.max_blocks:
            self._removed_at.popitem(last=False)

    def _clear(self, origin: str, stats: OriginStats) -> None:
        stats.cleared += 1
        for ident in [i for i in self.blocks if i[0] == origin]:
            if ident in self.blocks:
                self._drop(self.blocks[ident])
        stats.held = stats.let_go = 0

    def restart(self, origin: str) -> int:
        """The origin's publisher restarted (a new process): the blocks the old one held are gone with it. They leave
        the view and `held`, are counted in `gone`, and its sequence is followed anew; the count gone."""
        stats = self.stats(origin)
        gone = stats.held
        for ident in [i for i in self.blocks if i[0] == origin]:
            self._drop(self.blocks[ident])
        for ident in [i for i in self._removed_at if i[0] == origin]:  # a new process's stores are not churn
            del self._removed_at[ident]
        stats.restarts += 1
        stats.gone += gone
        stats.held = stats.let_go = 0
        stats.last_seq = -1
        return gone

    def _drop(self, block: Block) -> None:
        """Forget one block; its children stay as the tops of its chain (orphans: their parent went)."""
        del self.blocks[(block.origin, block.group, block.key)]
        tops = self.tops.get(block.chain)
        if block.parent is not None:
            block.parent.children.remove(block)
        elif tops is not None and block in tops:
            tops.remove(block)
        for child in block.children:
            child.parent, child.orphan = None, True
            self.tops.setdefault(block.chain, []).append(child)
        if not self.tops.get(block.chain, True):
            del self.tops[block.chain]
        siblings = self._by_first.get(block.sibling_key)
        if siblings is not None and block in siblings:
            siblings.remove(block)
            if not siblings:
                del self._by_first[block.sibling_key]

    def _let_go_oldest(self) -> None:
        while len(self.blocks) > self.max_blocks:
            block = next(iter(self.blocks.values()))
            self._drop(block)
            self.let_go += 1
            self.stats(block.origin).let_go += 1  # still held by the server: `held` keeps counting it

    def _origin_words(self, origin: str) -> str:
        return f" on {origin}" if origin and len(self.origins) > 1 else ""

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


def _common_prefix(a: array, b: array) -> int:
    """How many first tokens two blocks share: slice comparisons (C) in a bisection, not a loop over tokens."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


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


def _first(tokens: array) -> int:
    return int(tokens[0]) if len(tokens) else -1


def summary_lines(cache: PrefixCache) -> list[str]:
    """What a run saw, per publisher: the headless runner's last lines, `kvtui replay --print` and the diff's."""
    lines = []
    for origin, stats in cache.origins.items():
        capacity = f" of {stats.capacity}" if stats.capacity else ""
        lines.append(
            f"{origin or 'events'}: {stats.batches} batches, {stats.events} events; blocks stored {stats.stored}, "
            f"removed {stats.removed}, held {stats.held}{capacity}; cleared {stats.cleared}; lost batches "
            f"{stats.lost}; undecodable or unknown {stats.skipped}; stored again soon after removal {stats.restored}"
            + (f"; restarts {stats.restarts} (blocks gone with them {stats.gone})" if stats.restarts else "")
        )
        samples = cache.metrics.get(origin)
        if samples and samples[-1].overall is not None:
            last = samples[-1]
            lines.append(
                f"{origin}: prefix cache hit rate {last.overall:.1%} ({last.hits:.0f} of {last.queries:.0f} tokens)"
            )
    chains = len(cache.tops)
    lines.append(f"chains {chains}, blocks held {cache.held}, let go past --max-blocks {cache.let_go}")
    codes = cache.note_counts
    lines.append("notes: " + (", ".join(f"{code} ×{n}" for code, n in sorted(codes.items())) or "none"))
    return lines

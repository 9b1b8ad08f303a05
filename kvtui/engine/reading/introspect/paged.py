"""transformers' paged cache (`PagedAttentionCache`, continuous batching) read as plain values: each cache group's
allocator and block tables, one request's blocks and how many are shared or hashed, and each group's totals.

Duck-typed across layouts (5.24: `cache_allocators` with block tables and ledgers, a pool of sectors; 4.57:
`group_cache_managers` with `_block_table`, one free list): nothing here imports transformers. No K/V is read:
O(groups + the blocks of the requests asked about), and O(blocks held) only on 4.57's used count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...records.snapshot import frozen


@frozen
class RequestBlocks:
    """One request's blocks in one cache group, in block-table order (block i holds tokens i*P..(i+1)*P-1)."""

    group: str  # "full_attention", "sliding_attention", ...
    blocks: tuple[int, ...]  # physical block ids
    refs: tuple[int, ...]  # requests referencing each block (1: its own; 2+: shared through the ledger)
    hashed: int  # blocks registered by content hash (complete, reusable by a later prompt with the same prefix)

    @property
    def shared(self) -> tuple[int, ...]:
        """The blocks another request references too."""
        return tuple(block for block, refs in zip(self.blocks, self.refs) if refs > 1)


@frozen
class CacheGroup:
    """One cache group of the paged cache (one allocator: the layers of one attention type)."""

    name: str  # "full_attention", "sliding_attention"
    layers: tuple[int, ...]  # the model layers whose K/V it holds
    block_tokens: int  # tokens per block (a block has one page of block_tokens tokens per layer)
    total: int  # blocks the whole cache holds for this group (the cache's sectors are shared between groups)
    used: int  # distinct blocks in live requests' block tables
    free: int  # blocks it can still hand out (free blocks of its sectors + free sectors)
    shared: int  # blocks referenced by 2+ requests
    cached: int  # blocks no request references, kept for their content (prefix sharing may reuse them)


@frozen
class Allocator:
    """One cache group's allocator, whichever layout: its name, block table per request, ledger."""

    name: str
    table: Mapping[str, Any]  # request id -> block ids
    source: Any  # the allocator object


def allocators_of(cache: Any) -> list[Allocator]:
    """5.24: cache.cache_allocators {attention type: allocator with block_table and ledger}; 4.57:
    cache.group_cache_managers [allocator with _block_table], no ledger."""
    found = []
    allocators = getattr(cache, "cache_allocators", None)
    if isinstance(allocators, Mapping):
        for name, allocator in allocators.items():
            table = getattr(allocator, "block_table", None)
            if isinstance(table, Mapping):
                found.append(Allocator(str(name), table, allocator))
        return found
    for allocator in getattr(cache, "group_cache_managers", None) or ():
        table = getattr(allocator, "_block_table", None)
        if isinstance(table, Mapping):
            kind = "sliding_attention" if "Sliding" in type(allocator).__name__ else "full_attention"
            found.append(Allocator(kind, table, allocator))
    return found


def paged_layout(cache: Any) -> str:
    if isinstance(getattr(cache, "cache_allocators", None), Mapping):
        return "allocators"
    return "group-managers" if getattr(cache, "group_cache_managers", None) is not None else "unknown"


def request_blocks(allocator: Allocator, request_id: str) -> RequestBlocks:
    blocks = tuple(int(b) for b in allocator.table.get(request_id, ()))
    ledger = getattr(allocator.source, "ledger", None)
    counts = getattr(ledger, "shared_ref_counts", None) or {}  # only blocks with 2+ references have an entry
    hashes = getattr(ledger, "block_to_hash", None) or {}
    hashed = 0
    for block in blocks:
        if block not in hashes:
            break
        hashed += 1
    refs = tuple(int(counts.get(b, 1)) for b in blocks)
    return RequestBlocks(group=allocator.name, blocks=blocks, refs=refs, hashed=hashed)


def cache_groups(cache: Any, allocators: list[Allocator]) -> tuple[CacheGroup, ...]:
    groups = []
    pool = getattr(cache, "pool", None)  # 5.24: sectors handed to the groups on demand
    free_sectors = int(getattr(pool, "num_free_sectors", 0) or 0)
    for allocator in allocators:
        source = allocator.source
        ledger = getattr(source, "ledger", None)
        if pool is not None and hasattr(pool, "count_free_blocks"):
            free = int(pool.count_free_blocks(source.index)) + free_sectors * int(source.blocks_per_sector)
        else:  # 4.57: one free list for every group
            free = len(getattr(cache, "_free_blocks", None) or ())
        total = int(getattr(source, "num_blocks", None) or getattr(cache, "num_blocks", 0) or 0)
        cached = len(getattr(ledger, "cached_blocks", None) or ())
        if pool is not None and hasattr(pool, "count_free_blocks"):
            # 5.24: a block is free, cached (kept, unreferenced) or used: O(1), not a walk of every block table
            # (tests check it against the union of the live requests' tables, forward by forward)
            used = total - free - cached
        else:  # 4.57: the tables' union, O(blocks held)
            used = len({int(b) for table in allocator.table.values() for b in table})
        layers = getattr(source, "layer_indices", None)
        if layers is None:  # 4.57: layer -> (group, index in group)
            where = getattr(cache, "layer_index_to_group_indices", None) or {}
            layers = [layer for layer, (group, _) in where.items() if group == getattr(source, "_index", -1)]
        groups.append(
            CacheGroup(
                name=allocator.name,
                layers=tuple(int(layer) for layer in layers),
                block_tokens=int(getattr(source, "tokens_per_page", None) or getattr(source, "block_size", 0) or 0),
                total=total,
                used=used,
                free=free,
                shared=len(getattr(ledger, "shared_ref_counts", None) or ()),
                cached=cached,
            )
        )
    return tuple(groups)

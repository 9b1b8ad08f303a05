"""Each prefill a server announced, as one request's row: the tokens it found cached (its hits), those it stored
new (its misses) and the miss cause a rule named (rules.py).

By default vLLM announces only new full blocks. A request's hits are then inferred from its chain: the blocks
before its first new one were held, so the server used them again. A request whose whole prompt hit stores
nothing and is not seen at all (unless its blocks came back from a slower tier: stored again, one row, new 0).

A request sent with `"vllm_xargs": {"kv_cache_report_mode": "full"}` makes vLLM 0.32 announce its reused blocks
as well, when it is scheduled (`KVCacheManager.get_computed_blocks`). The announcement is a BlockStored from the
prompt's first block (no parent) whose blocks the server holds already. kvtui reads such an event as that
request's hits, reported by the server: no store, no miss, and no hash stored again. The request's new blocks
follow in the same step, going on from the last reported block. A report for blocks kvtui never saw stored
(because it attached later) cannot be told from a prefill, so it is read as one.

Events carry no request id. Where the client gives a session (`session_id` in the body, the X-Session-ID header
or `vllm_xargs.session_id`), vLLM puts it on both events, and a row shows it. Without a session, a store that
goes on from the newest row's last block is counted to that row: the same request's next prompt chunk, or the
blocks it generates.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..records.snapshot import frozen

ROWS_KEPT = 500  # newest request rows kept (per cache; the counts per origin are exact)

Ident = tuple[str, int, str]  # (origin, group, hash), as PrefixCache keys a block


@dataclass(slots=True)
class RequestRow:
    """One request as the events tell it (kvtui's object: a continuation adds to `new`)."""

    ts: float
    origin: str
    group: int
    session: str | None
    hit: int | None  # tokens it found cached (None: unknown: its chain began before kvtui attached, or was let go)
    reported: bool  # the hit as the server reported it (kv_cache_report_mode full), not inferred from the chain
    new: int = 0  # tokens it stored new: its prompt past the hit, and full blocks it generated
    cause: str | None = None  # the code of the miss cause a rule named on its prefill
    chain: int = 0
    last: Ident | None = None  # its newest block: where its next blocks go on from


@frozen
class RequestFacts:
    """One row as the screen shows it (a copy)."""

    ts: float
    origin: str
    session: str | None
    hit: int | None
    reported: bool
    new: int
    cause: str | None
    chain: int

    @classmethod
    def of(cls, row: RequestRow) -> RequestFacts:
        return cls(row.ts, row.origin, row.session, row.hit, row.reported, row.new, row.cause, row.chain)


class RequestLog:
    """The newest rows, and per origin the row its next blocks go to. O(1) per event."""

    def __init__(self, kept: int = ROWS_KEPT):
        self.rows: deque[RequestRow] = deque(maxlen=kept)
        self._open: dict[tuple[str, int], RequestRow] = {}  # (origin, group) -> its newest row

    def reported(self, origin: str, group: int, session: str | None, tokens: int, last: Ident, chain: int, ts: float):
        """A request's reused blocks, as the server reported them: a new row."""
        row = RequestRow(ts, origin, group, session, tokens, True, chain=chain, last=last)
        self._add(row)

    def going_on(self, origin: str, group: int, session: str | None, parent: Ident | None) -> RequestRow | None:
        """The row whose request stores these blocks, where they go on from its last block (and the session, where
        the events carry one, is the same)."""
        row = self._open.get((origin, group))
        if row is None or parent is None or row.last != parent:
            return None
        if session is not None and row.session is not None and session != row.session:
            return None
        return row

    def prefill(self, origin: str, group: int, session: str | None, hit: int | None, chain: int, ts: float):
        """A new prefill (a new chain, or a branch of one) whose hits are inferred: a new row."""
        row = RequestRow(ts, origin, group, session, hit, False, chain=chain)
        self.rows.append(row)
        self._open[(origin, group)] = row
        return row

    def _add(self, row: RequestRow) -> None:
        self.rows.append(row)
        self._open[(row.origin, row.group)] = row

    def forget(self, origin: str) -> None:
        """The origin's blocks are gone (cleared, restarted): nothing goes on from its rows."""
        for key in [k for k in self._open if k[0] == origin]:
            del self._open[key]

    def newest(self, count: int) -> tuple[RequestFacts, ...]:
        """The newest `count` rows, newest first."""
        out: list[RequestFacts] = []
        for row in reversed(self.rows):
            if len(out) >= count:
                break
            out.append(RequestFacts.of(row))
        return tuple(out)

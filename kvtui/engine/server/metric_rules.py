"""The rules judged on a server's own /metrics at each poll (codes in records/codes.py), beside what its events say:

- `short-prompt` (info): requests whose prompt is shorter than one block share nothing (a prefix cache stores and
  matches whole blocks; a prompt that stores no block publishes no event, so only /metrics can tell). Counted from
  vLLM's prompt-length histogram (`vllm:request_prompt_tokens`) since kvtui attached: per poll interval, the
  requests in buckets below one block, and the rest too where the interval's prompt-token sum leaves none of them
  room for a whole block (one request per interval: its exact length). A floor, never a prompt that filled a block.
  Noted once, then at each doubling of the count (a flood is counted, not listed).
- `metrics-disagree` (warning): the tokens the events announced stored disagree with the prefix-cache counters
  (`vllm:prefix_cache_queries` / `_hits`, in tokens). Compared only where comparable: between two *settled*
  polls (no request running or waiting, and the counters unchanged since the poll before: events and metrics
  arrive by separate paths, so a busy interval is never judged), with no preemption (its tokens are computed
  again outside `queries`), no batch lost, no restart and one cache group in the interval. Over such an interval
  of n finished requests, with Q queried, H hit and G generated tokens and blocks of B tokens, the full blocks of
  what the prefills computed are at least (Q - H) - n * (B - 1) tokens (each prompt's last partial block aside),
  and everything stored was computed: at most (Q - H) + G. Outside that range the note gives both numbers, once
  it held at every settled poll for CONFIRM_S seconds of the polls' own time (late events are applied by then: a
  loaded host delivered a replica's events more than two polls after its /metrics counted the request).

Per poll O(origins of the server + histogram buckets); never O(blocks held).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..records.snapshot import Diagnostic, Where
from .blocks import OriginStats

CONFIRM_S = 10.0  # how long a disagreement must last at settled polls before it is noted


@dataclass
class _Point:
    """A settled poll: the server's counters and what its events had announced."""

    queries: float
    hits: float
    generated: float
    requests: float
    preemptions: float
    stored: int  # tokens in blocks its live batches announced
    lost: int
    restarts: int


@dataclass
class _Server:
    """What the rules remember of one server's polls."""

    counters: tuple | None = None  # the last poll's counters, requests running and waiting
    settled: _Point | None = None  # the last settled poll an interval is judged from
    # the poll time (ts) the interval first disagreed at a settled poll (None: it did not): noted if it still does
    # CONFIRM_S later
    pending_since: float | None = None
    requests: float | None = None  # the histogram's count, sum and buckets at the last poll
    prompt_tokens: float | None = None
    buckets: dict[float, float] | None = None
    short: int = 0  # requests counted as shorter than one block since kvtui attached
    short_noted: int = 0  # the count at the last short-prompt note (the next at twice it)
    compared: int = 0  # settled intervals judged (agreed or not)
    disagreed: int = 0


class MetricRules:
    """The metric rules' memory per server (its origins: the name, and name/dpN for its ranks)."""

    def __init__(self) -> None:
        self.servers: dict[str, _Server] = {}

    def judge(self, origin: str, metrics, origins: dict[str, OriginStats], batch: int, ts: float) -> list[Diagnostic]:
        """One poll of `origin`'s /metrics (server_http.CacheMetrics) at time `ts` (the poll's, as the trace keeps
        it); `origins`: the stats of every origin kvtui follows. The notes it raises."""
        server = self.servers.setdefault(origin, _Server())
        mine = [s for name, s in origins.items() if name == origin or name.startswith(origin + "/")]
        block = next((s.block_size for s in mine if s.block_size), 0) or (metrics.block_size or 0)
        notes: list[Diagnostic] = []
        self._short_prompts(origin, server, metrics, block, batch, notes)
        self._cross_check(origin, server, metrics, mine, block, batch, ts, notes)
        return notes

    # ---- short-prompt --------------------------------------------------------------------------------

    def _short_prompts(self, origin: str, server: _Server, metrics, block: int, batch: int, notes: list) -> None:
        if metrics.requests is None or metrics.prompt_tokens is None or metrics.prompt_buckets is None:
            return
        buckets = {float(bound): float(count) for bound, count in metrics.prompt_buckets}
        before = (server.requests, server.prompt_tokens, server.buckets)
        server.requests, server.prompt_tokens, server.buckets = metrics.requests, metrics.prompt_tokens, buckets
        if before[0] is None or before[1] is None or before[2] is None or block <= 0:
            return  # the first poll: what came before kvtui attached is not counted
        finished = metrics.requests - before[0]
        if finished <= 0:
            return  # none finished (or the server restarted: its counters start over)
        below = [bound for bound in buckets if bound < block]  # bucket bounds under one block
        low = max(below) if below else 0.0
        short = (buckets.get(low, 0.0) - before[2].get(low, 0.0)) if below else 0.0
        rest = finished - short
        if rest > 0:  # the others: all shorter than a block where the tokens left would not fill one for any
            tokens = metrics.prompt_tokens - before[1]
            longest = tokens - short - (rest - 1) * (low + 1)  # the most one of them can have
            if longest < block:
                short += rest
        if short <= 0:
            return
        server.short += int(short)
        if server.short >= 2 * server.short_noted:
            server.short_noted = max(1, server.short)
            count = server.short
            notes.append(
                Diagnostic(
                    "short-prompt",
                    "info",
                    f"{count} request{'s' if count != 1 else ''} on {origin or 'the server'} since kvtui attached had "
                    f"a prompt shorter than one block of {block} tokens (from its /metrics prompt-length histogram; at "
                    "least that many): the server caches and matches whole blocks, so nothing of them can be reused "
                    "and they publish no event (a shared start of at least one block, or smaller blocks, lets prompts "
                    "share)",
                    batch,
                    Where(origin=origin),
                )
            )

    # ---- metrics-disagree ----------------------------------------------------------------------------

    def _cross_check(
        self, origin, server: _Server, metrics, mine: list, block: int, batch: int, ts: float, notes: list
    ) -> None:
        needed = (metrics.queries, metrics.hits, metrics.generated, metrics.requests, metrics.running, metrics.waiting)
        if None in needed or not mine or block <= 0:
            return  # not a server that gives these (SGLang gives a rate), or no publisher of its own seen yet
        counters = (metrics.queries, metrics.hits, metrics.generated, metrics.requests, metrics.preemptions or 0.0)
        now = (*counters, metrics.running, metrics.waiting)
        quiet = metrics.running == 0 and metrics.waiting == 0 and now == server.counters  # idle at both polls
        server.counters = now
        if not quiet:
            server.pending_since = None  # served on: the longer interval is judged (and confirmed) on its own
            return
        point = _Point(
            *counters,
            stored=sum(s.live_tokens for s in mine),
            lost=sum(s.lost for s in mine),
            restarts=sum(s.restarts for s in mine),
        )
        base = server.settled
        if base is None or (base.queries, base.generated, base.requests) == (
            point.queries,
            point.generated,
            point.requests,
        ):
            if base is None or server.pending_since is None:
                server.settled = point  # nothing served since: the later of two settled polls is the start
                return
        comparable = (
            point.lost == base.lost
            and point.restarts == base.restarts
            and point.preemptions == base.preemptions
            and min(point.queries - base.queries, point.hits - base.hits, point.requests - base.requests) >= 0
            and point.generated >= base.generated
            and all(len(s.groups) <= 1 for s in mine)
        )
        if not comparable:
            server.settled, server.pending_since = point, None
            return
        computed = (point.queries - base.queries) - (point.hits - base.hits)
        finished = point.requests - base.requests
        generated = point.generated - base.generated
        stored = point.stored - base.stored
        least = computed - finished * (block - 1)
        most = computed + generated
        if least <= stored <= most:
            server.settled, server.pending_since = point, None
            server.compared += 1
            return
        if server.pending_since is None:
            server.pending_since = ts  # events still on their way are applied within CONFIRM_S
            return
        if ts - server.pending_since < CONFIRM_S:
            return
        server.settled, server.pending_since = point, None
        server.compared += 1
        server.disagreed += 1
        if stored < least:
            why = (
                f"fewer than the at least {least:.0f} tokens of whole blocks its prefills computed: events are missing"
            )
        else:
            why = f"more than the at most {most:.0f} tokens it computed ({generated:.0f} of them generated)"
        notes.append(
            Diagnostic(
                "metrics-disagree",
                "warning",
                f"the events of {origin or 'the server'} announced {stored} tokens stored in blocks of {block} over an "
                f"interval in which its /metrics counted {finished:.0f} requests, {point.queries - base.queries:.0f} "
                f"prompt tokens queried and {point.hits - base.hits:.0f} found in the prefix cache: {why} (requests "
                "that skip the prefix cache, as with prompt_logprobs, are counted in neither)",
                batch,
                Where(origin=origin),
            )
        )

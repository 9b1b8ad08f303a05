"""What a followed server's run saw, as text lines: the headless runner's last lines, `kvtui replay --print` and
`kvtui diff`'s totals."""

from __future__ import annotations

from .metrics import watched_rate
from .prefix_cache import PrefixCache


def summary_lines(cache: PrefixCache) -> list[str]:
    """What a run saw, per publisher, then the chains, the blocks and the notes by code."""
    lines = []
    for origin, stats in cache.origins.items():
        capacity = f" of {stats.capacity}" if stats.capacity else ""
        lines.append(
            f"{origin or 'events'}: {stats.batches} batches, {stats.events} events; blocks stored {stats.stored}, "
            f"removed {stats.removed}, held {stats.held}{capacity}; cleared {stats.cleared}; lost batches "
            f"{stats.lost}; undecodable or unknown {stats.skipped}; stored again soon after removal {stats.restored}; "
            f"removals of blocks never seen stored {stats.unknown_removed}; hashes stored again while held "
            f"{stats.stored_again}; unknown medium {stats.unknown_medium}"
            + (f"; caught up through replay {stats.caught_up} batches" if stats.caught_up else "")
            + (f"; restarts {stats.restarts} (blocks gone with them {stats.gone})" if stats.restarts else "")
            + (
                f"; removed from one medium while another held them {stats.kept_elsewhere}, stored back on a faster "
                f"medium {stats.offloaded_back}"
                if stats.kept_elsewhere or stats.offloaded_back
                else ""
            )
        )
        if stats.requests:
            lines.append(
                f"{origin or 'events'}: requests {stats.requests}: hits reported by the server {stats.reported_hits} "
                f"tokens ({stats.reports} requests sent with kv_cache_report_mode full), inferred from the chains "
                f"{stats.inferred_hits} tokens (a request whose whole prompt hit is seen only when reported)"
            )
        samples = cache.metrics.get(origin)
        if samples and samples[-1].overall is not None:
            last, watched = samples[-1], watched_rate(samples)
            over = f"{watched[0]:.1%} ({watched[1]:.0f} of {watched[2]:.0f} tokens)" if watched else "no queries yet"
            lines.append(
                f"{origin}: prefix cache hit rate while watched {over}; over the server's life {last.overall:.1%} "
                f"({last.hits:.0f} of {last.queries:.0f} tokens)"
            )
        checked = cache.metric_rules.servers.get(origin)
        if checked is not None and (checked.compared or checked.short):
            lines.append(
                f"{origin}: events against /metrics: {checked.compared} settled intervals compared, "
                f"{checked.disagreed} disagreed; prompts shorter than one block {checked.short}"
            )
    if len(cache.origins) > 1:
        twice = cache.duplicated()
        for origin, stats in cache.origins.items():
            lines.append(
                f"{origin}: fleet: {stats.routed_tokens} tokens prefilled here while another replica held them "
                f"(routing waste); {twice.get(origin, 0)} tokens held here that another replica holds too"
            )
        lines.append(
            f"fleet: routing waste {sum(s.routed_tokens for s in cache.origins.values())} tokens; tokens held more "
            f"than once {sum(twice.values())} (memory spent twice)"
        )
    chains = len(cache.tops)
    lines.append(f"chains {chains}, blocks held {cache.held}, let go past --max-blocks {cache.let_go}")
    codes = cache.note_counts
    lines.append("notes: " + (", ".join(f"{code} ×{n}" for code, n in sorted(codes.items())) or "none"))
    return lines

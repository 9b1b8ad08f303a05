"""Where a watched program hands a forward a mask that disagrees with the cache it continues: the watch side
of the rulebook's mask-length rule (reading/diagnostics.py)."""

from __future__ import annotations

from ..reading.silent_rules import check_mask_length
from ..records.snapshot import Diagnostic
from .watch_step import Call


def mask_against_cache(call: Call, step: int) -> list[Diagnostic]:
    """Before a forward the program made itself (not generate()'s), handed a cache and a 2-D mask: does the
    mask cover exactly the cached tokens and the fed ones? A static cache is left out (programs that size
    the mask to its capacity are not this bug's authors)."""
    if call.cache is None or call.mask_length is None or call.input_ids is None:
        return []
    if "Static" in type(call.cache).__name__:
        return []
    name = call.track.name if call.track is not None else type(call.cache).__name__
    held = call.track.held if call.track is not None else None
    if held is not None and call.mask_length == held.fed_total + call.n:
        return []  # a compressed cache: a mask over every token fed (generate's) is as right as one over its slots
    found = check_mask_length(step, name, call.mask_length, call.cache_length_before, call.n, f" [{call.caller}]")
    if found:  # the mask's ones count nothing true: positions are checked against the cache's own length
        call.real_before = [call.cache_length_before] * call.batch
    return found

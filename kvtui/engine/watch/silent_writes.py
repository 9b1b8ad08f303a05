"""Where a watched program's cache changed although the program said it must not, or did not change although
the program asked it to: the watch side of the rulebook's silent-write rules (reading/diagnostics.py)."""

from __future__ import annotations

import torch

from ..reading import introspect
from ..reading.silent_rules import check_edit_changed_nothing, check_written_without_use_cache
from ..records.snapshot import Diagnostic
from .watch_step import Call


def written_without_use_cache(call: Call, step: int) -> list[Diagnostic]:
    """After a forward that was handed a cache: did it write although `use_cache` was off (passed False, or
    not passed where the model's config says False)? Reads the cache's length once (O(1))."""
    if call.use_cache is None:
        config = getattr(call.probe.model, "config", None)
        if getattr(config, "use_cache", True) is not False:
            return []
    elif call.use_cache:
        return []
    name = call.track.name if call.track is not None else type(call.cache).__name__
    after = introspect.seq_length(call.cache)
    return check_written_without_use_cache(
        step, name, call.cache_length_before, after, call.use_cache, f" [{call.caller}]"
    )


def edit_changed_nothing(step: int, call: str, method: str, args: tuple, before: int, after: int) -> list[Diagnostic]:
    """A `crop`/`reset` the program called that left the cache as long as before (`call`: the edit as written
    and where). The first argument is read as an int where it is one (a 0-dim tensor too)."""
    first = args[0] if args else None
    if isinstance(first, torch.Tensor) and first.numel() == 1:
        first = int(first.item())
    return check_edit_changed_nothing(step, call, method, first if isinstance(first, int) else None, before, after)

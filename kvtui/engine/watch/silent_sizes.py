"""Where generate() made a cache other than the program asked for: the watch side of the rulebook's
cache-config rule (reading/diagnostics.py)."""

from __future__ import annotations

from ..reading import introspect
from ..reading.silent_rules import check_cache_config_size
from ..records.snapshot import Diagnostic
from .watch_step import Call


def asked_max_cache_len(generate_frame) -> int | None:
    """`max_cache_len` in the cache_config of generate()'s own generation config (the program's
    `cache_config=` argument or its GenerationConfig), read from generate()'s frame; None when none asked."""
    config = generate_frame.f_locals.get("generation_config")
    if getattr(config, "cache_implementation", None) != "static":
        return None
    asked = getattr(config, "cache_config", None)
    asked = asked.get("max_cache_len") if isinstance(asked, dict) else getattr(asked, "max_cache_len", None)
    return asked if isinstance(asked, int) else None


def static_size_ignored(call: Call, generate_frame, step: int) -> list[Diagnostic]:
    """At the first forward on a cache generate() made: is it the static size the program asked for?"""
    asked = asked_max_cache_len(generate_frame)
    made = introspect.static_capacity(call.cache) if asked is not None and hasattr(call.cache, "layers") else None
    if asked is None or made is None or call.track is None:
        return []
    return check_cache_config_size(step, call.track.name, asked, made, f" [{call.caller}]")

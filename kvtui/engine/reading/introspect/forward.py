"""Where a forward takes its cache and where its output returns it, by the names this transformers uses."""

from __future__ import annotations

import inspect
from functools import lru_cache
from itertools import compress, repeat


@lru_cache(maxsize=64)
def _forward_parameters(forward) -> frozenset[str]:
    return frozenset(inspect.signature(forward).parameters)


def forward_accepts(model, name: str) -> bool:
    """From 5.4 models take no `cache_position` and silently ignore one; 4.x needs it for static caches."""
    return name in _forward_parameters(type(model).forward)


# The names a forward's cache goes by: `cache` from 5.24, which still takes (and renames, with a deprecation
# warning) `past_key_values` and the SSM models' `cache_params`; `past_key_values` before. generate() passes
# the new name, a user's own loop either. Outputs likewise: `.cache` from 5.24, `.past_key_values` before.
CACHE_ARGUMENTS = ("cache", "past_key_values", "cache_params")


def cache_argument(model) -> str:
    """The keyword this model's forward takes its cache by: 'cache' (5.24+) or 'past_key_values'."""
    return "cache" if forward_accepts(model, "cache") else "past_key_values"


def _is_cache(value) -> bool:
    return hasattr(value, "get_seq_length")


def cache_in(arguments: dict):
    """The cache object among a forward's arguments (by any of its names, in their order), or None."""
    found = list(map(arguments.get, CACHE_ARGUMENTS))  # read by C-level passes: this runs on every forward
    return next(compress(found, map(hasattr, found, repeat("get_seq_length"))), None)


def output_cache(output):
    """The cache a forward returned, or None; read without tripping 5.24's deprecated-name warning."""
    if isinstance(output, dict):  # ModelOutput: an OrderedDict of the fields that are set (its get() would warn)
        found = list(map(dict.get, repeat(output), CACHE_ARGUMENTS))  # dict's own get, in C: every forward
        return next(compress(found, map(hasattr, found, repeat("get_seq_length"))), None)
    return next((v for name in CACHE_ARGUMENTS if _is_cache(v := getattr(output, name, None))), None)

"""The one place that knows transformers' cache internals, and how they differ between versions.

Everything here reads `.shape`, `.dtype`, counters and class names: O(layers), no K/V copies.
`truncate` also writes those internals (static caches have no `crop`), but only kvtui's own chat calls it
(`chat/edits.py`, the session's mixin that applies its rewinds and re-prefills): kvtui's own cache changes there
and in `session.py`'s forwards, nowhere else. The rest of kvtui imports this
package (`introspect.layer_infos(cache)`); its modules, by job:

- layers:       what one layer is and holds (its kind, token counters, storage bytes)
- infos:        one LayerInfo per layer (every step's record: the hot path)
- fingerprints: has the cache changed between two forwards (kvtui watch)
- truncation:   cutting a cache back in place (rewinds), and what stops it
- building:     a fresh cache of a kind, and the refusals where this transformers cannot build or hold it
- forward:      the names a forward takes its cache by and returns it under
- config:       what a model config says about its cache (state layers, heads, sliding window)
- paged:        continuous batching's paged cache: block tables, shared blocks, each group's totals
- transfer:     every tensor a step reads, brought to the host in one transfer
"""

from __future__ import annotations

from .building import (
    CACHE_KINDS,
    QUANT_BACKENDS,
    QUANT_GROUP,
    QUANT_RESIDUAL,
    TRANSFORMERS_VERSION,
    hybrid_refusal,
    make_cache,
    quant_backend_known,
    quant_backend_refusal,
    quant_backends,
)
from .config import attention_heads, config_window, declares_state
from .fingerprints import (
    Fingerprint,
    PendingEdit,
    changed,
    check_edits,
    describe_change,
    fingerprint,
    infos_and_fingerprint,
)
from .forward import CACHE_ARGUMENTS, cache_argument, cache_in, forward_accepts, output_cache
from .infos import layer_infos, static_capacity
from .layers import dequantized_kv, seq_length
from .transfer import HostReads
from .truncation import (
    activate_past_recording,
    can_truncate,
    has_linear_layers,
    records_past,
    truncate,
    truncate_blocker,
)

__all__ = [
    "CACHE_ARGUMENTS",
    "CACHE_KINDS",
    "QUANT_BACKENDS",
    "QUANT_GROUP",
    "QUANT_RESIDUAL",
    "TRANSFORMERS_VERSION",
    "Fingerprint",
    "HostReads",
    "PendingEdit",
    "activate_past_recording",
    "attention_heads",
    "cache_argument",
    "cache_in",
    "can_truncate",
    "changed",
    "check_edits",
    "config_window",
    "declares_state",
    "describe_change",
    "fingerprint",
    "infos_and_fingerprint",
    "forward_accepts",
    "has_linear_layers",
    "hybrid_refusal",
    "layer_infos",
    "make_cache",
    "output_cache",
    "quant_backend_known",
    "quant_backend_refusal",
    "quant_backends",
    "records_past",
    "seq_length",
    "dequantized_kv",
    "static_capacity",
    "truncate",
    "truncate_blocker",
]

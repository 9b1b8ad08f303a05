"""The registry of alarm codes: every Diagnostic kvtui raises (its own chat, a watched program or process tree, a
packed batch, a server's prefix cache) carries one of these codes, each with one meaning and one severity rule.

`Diagnostic` refuses a code that is not here, or a severity its rule does not allow (snapshot.py), so no producer
can invent a code; tests/engine/records/test_codes.py checks every code against the README's alarm table.
Codes renamed since a trace was written are mapped back when it is read (`RENAMED`, `current_code`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Code:
    name: str
    severities: tuple[str, ...]  # the severities its rule can give (the README's severity cell names each)
    severity_rule: str  # when which severity
    meaning: str  # what it says, in one line (the README row says it in full)


def _code(name: str, severity_rule: str, meaning: str, severities: tuple[str, ...] = ()) -> Code:
    return Code(name, severities or (severity_rule,), severity_rule, meaning)


_ALL = (
    # kvtui's own chat and a watched program alike (reading/diagnostics.py)
    _code(
        "tokenizer-added-special",
        "info for a lone BOS, warning otherwise",
        "the tokenizer inserted special tokens the text did not contain",
        ("info", "warning"),
    ),
    _code("double-bos", "warning", "a BOS follows another BOS"),
    _code("eos-in-context", "warning", "an end token enters the context where the template did not put it"),
    _code("cursor-mismatch", "error", "a next write position differs from the cache's length"),
    _code("position-gap", "error", "applied positions do not continue what the cache (or a request's cache) held"),
    _code(
        "template-drift",
        "warning",
        "what the cache (or a server's cached chain) holds and the new rendering differ only in what a chat template "
        "renders: the cached tokens after it cannot be reused",
    ),
    _code(
        "static-capacity",
        "warning near full, error on refusal",
        "a static cache is nearly full, or a forward would overflow it",
        ("warning", "error"),
    ),
    _code("sliding-eviction", "info", "sliding-window layers no longer hold early positions"),
    _code("state-rewind", "info", "a rewind on layers that cannot be cut per token: how it was done"),
    _code("pad-in-cache", "warning", "pad tokens were written to the cache with attention"),
    _code("cache-mismatch", "error", "verify: cached logits differ from a full recompute beyond tolerance"),
    _code("worker-error", "error", "an exception in the engine, or the engine process died"),
    # watched programs (kvtui watch)
    _code(
        "cache-edited",
        "info for the cache's own method, warning for an in-place write",
        "the cache changed between two forwards without a forward",
        ("info", "warning"),
    ),
    _code(
        "cache-evicted",
        "info for an eviction, error for a layer left empty or K and V kept from different tokens",
        "a press or the program evicted positions from the cache (inside a forward or between two): what each "
        "layer still holds",
        ("info", "error"),
    ),
    _code(
        "compression-cost",
        "info",
        "verify of a compressed cache: what the eviction cost the next-token distribution against the uncompressed "
        "recompute (top-1 agreement, KL divergence), per verify and over the run",
    ),
    _code("ignored-argument", "warning", "an argument this transformers version ignores was passed"),
    _code("padding-side", "warning", "a batch row ends with pads (right padding on a decoder-only model)"),
    _code("stale-cache", "warning", "a cache holds tokens that are not a prefix of the prompt it continues"),
    _code(
        "recomputed-prefix",
        "info for a program's or a batch's caches, warning for a server's prefix cache",
        "a prefill recomputed tokens a cache already held: another cache of the program, another request of the "
        "batch, or a cached chain of the server",
        ("info", "warning"),
    ),
    _code("request-requeued", "info", "continuous batching: a request went back to waiting and resumed"),
    _code(
        "short-prompt",
        "info",
        "prompts shorter than one cache block share nothing (a prefix cache stores and matches whole blocks): "
        "counted, one note then one per doubling",
    ),
    _code(
        "prefix-under-block",
        "info",
        "a prompt shares a start with a prompt the cache holds or held, but fewer tokens than one block (hybrid "
        "attention + Mamba models' blocks are hundreds of tokens): none of it was reused; counted, one note then one "
        "per doubling",
    ),
    # a watched command's tree (kvtui watch -- COMMAND)
    _code("rank-desync", "error", "the ranks of a tensor-parallel run disagree at the same forward"),
    # silent cache bugs users report (reading/silent_rules.py)
    _code("cache-written-without-use-cache", "warning", "a forward with use_cache off still wrote into its cache"),
    _code("edit-changed-nothing", "warning", "a crop or reset left the tokens it was asked to remove"),
    _code("mask-length", "warning", "an attention_mask's columns do not line up with the cache's slots"),
    # seen in the captured attention (--attention / watch(attention=True): reading/attention.py)
    _code("attended-pads", "warning", "pads receive attention the mask should have removed (their share, positions)"),
    # a server's prefix cache followed through its KV events (server/rules.py)
    _code("varying-start", "warning", "prompts keep leaving one cached chain at one token with different text there"),
    _code("cache-churn", "warning", "blocks removed and stored again soon after: the cache is too small"),
    _code(
        "evicted-prefix",
        "info",
        "a prefill stored blocks the server had held and evicted (or cleared) before: when, at what age, after how "
        "many later prefills continued them",
    ),
    _code(
        "hash-mismatch",
        "warning",
        "a prefill stored tokens the server holds already under another hash (another LoRA, other extra keys)",
    ),
    _code(
        "metrics-disagree",
        "warning",
        "the tokens a server's events announced stored disagree with its own /metrics prefix-cache counters over a "
        "settled interval (both numbers)",
    ),
    _code(
        "offloaded-prefix",
        "info",
        "a prefill stored on the server's first tier (GPU) blocks that its events say another medium held (CPU, "
        "disk: offloaded): the medium, how many tokens (loaded back by an offloading connector, not lost)",
    ),
    _code(
        "held-elsewhere",
        "warning",
        "a prefill on one replica (server or data-parallel rank) of tokens another replica held at that moment",
    ),
)

CODES: dict[str, Code] = {code.name: code for code in _ALL}

# old name -> the code that now says it (a trace written before the rename still reads)
RENAMED: dict[str, str] = {
    "prefix-miss": "recomputed-prefix",  # a server's prefill that recomputed a cached chain's tokens
}


def current_code(name: str) -> str:
    """The registered code for a name read from a trace (renamed codes mapped; others unchanged)."""
    return RENAMED.get(name, name)


def check_code(code: str, severity: str) -> None:
    """Raise ValueError unless `code` is registered and its rule allows `severity` (Diagnostic calls it)."""
    found = CODES.get(code)
    if found is None:
        raise ValueError(f"unregistered alarm code {code!r} (kvtui/engine/records/codes.py lists the codes)")
    if severity not in found.severities:
        raise ValueError(f"alarm code {code!r} is never {severity!r} (its rule: {found.severity_rule})")

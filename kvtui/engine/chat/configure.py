"""What the engine makes of a complete options dict (kvtui.options.AppConfig.options: every key, the CLI's
defaults merged in): the session's configuration, the model's loading and its threads. The engine process
reads its options here, so it needs nothing above the engine layer."""

from __future__ import annotations

from collections.abc import Callable

from .settings import SamplerSettings

STATIC_DEFAULT_CAPACITY = 2048  # a static cache's slots when --max-cache-len does not say


class WatchTokenError(ValueError):
    """A --watch token that is not one token of this tokenizer."""


def session_config(options: dict, tokenizer=None):
    """A SessionConfig from complete options (watch tokens are resolved with the tokenizer).

    Decode threads: --decode-threads, else torch's threads as they are (--threads, or torch's choice), whatever
    drives the session (the TUI's engine, --headless, a script, a notebook). Keeping a core for the TUI's
    repaints was measured and did not pay on 2 cores: its engine's OpenMP threads spin briefly, then sleep
    (records/child.py openmp_wait), so a repaint costs the team a short wait (benchmarks/RESULTS.md, section 11).
    A sum split over another number of threads rounds differently in its last bits: two front ends write the
    same trace when given the same threads."""
    from .session import SessionConfig

    cache = options["cache"]
    max_cache_len = options.get("max_cache_len") or (STATIC_DEFAULT_CAPACITY if cache == "static" else None)
    sampler = SamplerSettings(
        temperature=options["temperature"],
        top_k=options["top_k"],
        top_p=options["top_p"],
        repetition_penalty=options["repetition_penalty"],
        seed=options["seed"],
    )
    watch = tuple(resolve_token(tokenizer, w) for w in options.get("watch") or ()) if tokenizer else ()
    return SessionConfig(
        cache=cache,
        max_cache_len=max_cache_len,
        max_new_tokens=options["max_new_tokens"],
        cache_bits=int(options.get("cache_bits") or 4),
        cache_backend=options.get("cache_backend") or "quanto",
        compile=bool(options.get("compile_decode")),
        sampler=sampler,
        mode=options["mode"],
        system=options.get("system"),
        chat_tokenize=options["chat_tokenize"],
        top_k_shown=options["show_top"],
        watch=watch,
        prime_pad=options["prime_pad"],
        attention=bool(options.get("attention")),
        decode_threads=options.get("decode_threads"),
        press=options.get("press") or None,
    )


def resolve_token(tokenizer, text: str) -> int:
    """A watched token: a number is an id; text must encode to exactly one token."""
    if str(text).isdigit():
        return int(text)
    ids = tokenizer(str(text), add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise WatchTokenError(f"--watch {text!r} is {len(ids)} tokens {ids}; watch one token (or give its id)")
    return ids[0]


def load(model: str | None, options: dict, progress=None):
    """Load the model complete options name (dtype, device, device map; --attention keeps the model's own
    attention implementation: the capture wraps it, reading/attention.py)."""
    from .loader import load_model

    set_threads(options)
    return load_model(
        model,
        dtype=options["dtype"],
        device=options["device"],
        device_map=options["device_map"],
        progress=progress,
    )


def set_threads(options: dict) -> None:
    """--threads: the model's CPU threads, set before the first forward (in the process that runs it)."""
    if options.get("threads"):
        import torch

        torch.set_num_threads(options["threads"])


def prepare_cache_backend(config, device: str, progress: Callable[[str], object] | None = None) -> None:
    """optimum-quanto compiles its C++ kernels the first time a quantized value is read back: in a chat that is
    mid-turn, once the tokens outgrow the full-precision window, and on 2 cores a stall of a minute or two
    with no word. One tiny quantize/dequantize round trip on the model's device makes that wait happen here,
    at load, under a progress line (milliseconds once the kernels exist). A build that fails is one line
    here, not an exception mid-turn."""
    if config.cache != "quantized" or config.cache_backend != "quanto":
        return
    import torch
    from optimum.quanto import MaxOptimizer, qint2, qint4, quantize_weight

    from .session import SessionError

    if progress is not None:
        progress("optimum-quanto: preparing its kernels (built once, on first use: up to 2 minutes)")
    qtype = qint4 if config.cache_bits == 4 else qint2
    values = torch.randn(1, 1, 64, 32, device=device)  # [batch, heads, tokens, head dim]
    try:
        scale, zeropoint = MaxOptimizer()(values, qtype, -1, 32)  # as transformers' quanto layer quantizes
        quantize_weight(values, qtype, -1, scale, zeropoint, 32).dequantize()
    except Exception as exc:  # noqa: BLE001  a compiler missing, a build error: said once, before any turn
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SessionError(f"optimum-quanto could not prepare its kernels for {device}: {first}") from None

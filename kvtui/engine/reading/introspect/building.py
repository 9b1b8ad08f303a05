"""A fresh cache of the kind asked for, and the refusals where this transformers cannot build or hold one.

What this transformers can do is found by feature tests (build the object, read what it says), never from
its version number.
"""

from __future__ import annotations

from functools import lru_cache

import transformers
from transformers import DynamicCache, StaticCache

from .config import declares_state, text_config
from .layers import is_linear


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


TRANSFORMERS_VERSION = _version(transformers.__version__)


CACHE_KINDS = ("dynamic", "static", "quantized", "offloaded")
QUANT_BACKENDS = ("quanto", "hqq", "fp8")
# Group size and full-precision window of the quantized cache: small enough that a short chat quantizes.
QUANT_GROUP = 32
QUANT_RESIDUAL = 32


def make_cache(kind: str, config, max_cache_len: int | None = None, *, bits: int = 4, backend: str = "quanto"):
    """A fresh cache of the kind asked for, with per-layer types from the config (sliding or full)."""
    if kind == "dynamic":
        try:
            cache = DynamicCache(config=config)
        except TypeError:  # very old signature: full layers only
            cache = DynamicCache()
    elif kind == "offloaded":
        try:
            cache = DynamicCache(config=config, offloading=True)
        except TypeError as exc:
            raise ValueError(
                f"this transformers ({transformers.__version__}) has no offloaded DynamicCache: {exc}"
            ) from None
    elif kind == "static":
        if not max_cache_len or max_cache_len < 1:
            raise ValueError("a static cache needs --max-cache-len N (N >= 1)")
        cache = StaticCache(config=config, max_cache_len=max_cache_len)
    elif kind == "quantized":
        cache = _quantized_cache(config, bits, backend)
    else:
        raise ValueError(f"unknown cache kind {kind!r}: use {', '.join(CACHE_KINDS)}")
    _tag_state_kind(cache, config)
    return cache


def _quantized_cache(config, bits: int, backend: str):
    try:
        from transformers import QuantizedCache
    except ImportError:
        raise ValueError(f"this transformers ({transformers.__version__}) has no QuantizedCache") from None
    if backend not in QUANT_BACKENDS:
        raise ValueError(f"unknown quantization backend {backend!r}: use {', '.join(QUANT_BACKENDS)}")
    refusal = quant_backend_refusal(backend)
    if refusal:
        raise ValueError(refusal)
    if backend == "fp8":
        kwargs = {}
    else:
        kwargs = dict(nbits=bits, q_group_size=QUANT_GROUP, residual_length=QUANT_RESIDUAL)
    try:
        return QuantizedCache(backend=backend, config=config, **kwargs)
    except ImportError as exc:  # the backend package is missing
        raise ValueError(f"the {backend} quantized cache needs its package: {_first_line(exc)}") from None
    except (ValueError, TypeError) as exc:  # e.g. sliding or linear layers: "only ... full attention layers"
        raise ValueError(f"quantized cache refused by transformers: {_first_line(exc)}") from None


@lru_cache(maxsize=8)
def quant_backend_known(backend: str) -> bool:
    """Feature test: does this transformers' `QuantizedCache` know the backend? (4.57 knows quanto and hqq;
    fp8 came later.) Asked of QuantizedCache itself on a one-layer config: only its "unknown backend"
    refusal says no; a missing backend package (ImportError) or anything else means it knows the name."""
    try:
        from transformers import PretrainedConfig, QuantizedCache
    except ImportError:
        return False
    try:
        QuantizedCache(backend=backend, config=PretrainedConfig(num_hidden_layers=1))
    except ValueError as exc:
        return "nknown quantization backend" not in str(exc)
    except Exception:  # noqa: BLE001 - the package, the config: it got past the backend's name
        return True
    return True


def quant_backends() -> tuple[str, ...]:
    return tuple(b for b in QUANT_BACKENDS if quant_backend_known(b))


def quant_backend_refusal(backend: str) -> str | None:
    """One line where this transformers' QuantizedCache lacks the backend (checked before any screen)."""
    if backend not in QUANT_BACKENDS or quant_backend_known(backend):
        return None
    return (
        f"--cache-backend {backend}: this transformers ({transformers.__version__}) has no {backend} quantized "
        f"cache (its QuantizedCache knows {', '.join(quant_backends()) or 'no backend'})"
    )


def _dynamic_cache_keeps_state(config) -> bool:
    try:
        cache = DynamicCache(config=config)
    except Exception:  # noqa: BLE001 - a cache it cannot build keeps nothing
        return False
    return any(is_linear(layer) for layer in getattr(cache, "layers", ()))


def hybrid_refusal(config) -> str | None:
    """One line where the model keeps conv/SSM state that this transformers' DynamicCache does not hold
    (4.57: hybrids keep it in their own cache class, which kvtui does not read), else None.
    A feature test: build `DynamicCache(config=...)` and look for layers with conv/recurrent states."""
    if not declares_state(config):
        return None
    if _dynamic_cache_keeps_state(config):
        return None
    name = getattr(config, "model_type", None) or type(config).__name__
    return (
        f"{name} keeps conv/SSM state that this transformers ({transformers.__version__}) does not put in "
        f"DynamicCache's layers (it uses the model's own cache class): kvtui cannot inspect this hybrid here "
        f"(transformers 5.23+ can)"
    )


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _tag_state_kind(cache, config) -> None:
    """Remember what a linear layer's state is (ssm, linear attention, conv): the cache object cannot tell."""
    text = text_config(config)
    if any(hasattr(text, name) for name in ("mamba_d_state", "ssm_state_size", "state_size")):
        kind = "ssm"  # Mamba / Mamba-2 blocks (Jamba, Falcon-H1, Bamba, ...)
    elif hasattr(text, "linear_conv_kernel_dim") or hasattr(text, "linear_key_head_dim"):
        kind = "linear"  # gated delta rule / linear attention (Qwen3-Next, Qwen3.5)
    else:
        kind = None  # decided from the states: conv-only layers are "conv"
    try:
        cache._kvtui_state_kind = kind
    except AttributeError:  # a cache class with __slots__: fall back to the states
        pass

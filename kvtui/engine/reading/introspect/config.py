"""What a model's config says about its cache: conv/SSM state besides K/V, attention heads, sliding window."""

from __future__ import annotations

# What a config declares when its model keeps conv / SSM / linear-attention state besides (or instead of) K/V.
_STATE_ATTRIBUTES = (
    "mamba_d_state",
    "ssm_state_size",
    "state_size",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "conv_L_cache",
)
_ATTENTION_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}


def text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def declares_state(config) -> bool:
    text = text_config(config)
    types = getattr(text, "layer_types", None)
    if types:  # the layers say it (an LFM2 of attention layers only keeps no conv state)
        return any(t not in _ATTENTION_TYPES for t in types)
    return any(hasattr(text, name) for name in _STATE_ATTRIBUTES)


def attention_heads(config) -> tuple[int | None, int | None]:
    """(query heads, KV heads) from the text config, for the layers pane's totals."""
    text = text_config(config)
    query = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", None)
    kv = getattr(text, "num_key_value_heads", None) or query
    return query, kv


def config_window(config) -> int | None:
    text = text_config(config)
    return getattr(text, "sliding_window", None)

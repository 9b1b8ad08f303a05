"""The tiny models' configs: dimensions shared by every family and one ``make_config`` per family,
``(vocab_size, layers, window, special ids) -> config``. transformers is imported when a config is made."""

from __future__ import annotations

from typing import Any

# Model dimensions shared by every arch: small enough to build in well under a second.
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 128
MAX_POSITIONS = 4096


def llama_config(vocab, layers, window, ids):
    from transformers import LlamaConfig

    return LlamaConfig(**_decoder_kwargs(vocab, layers, ids), tie_word_embeddings=False)


def qwen2_config(vocab, layers, window, ids):
    from transformers import Qwen2Config

    # Qwen2 derives head_dim from hidden/heads; small Qwen2 checkpoints tie embeddings.
    kwargs = _decoder_kwargs(vocab, layers, ids)
    kwargs.pop("head_dim")
    return Qwen2Config(**kwargs, tie_word_embeddings=True, use_sliding_window=False)


def qwen3_config(vocab, layers, window, ids):
    from transformers import Qwen3Config

    # Qwen3Config defaults head_dim to 128, so it must be passed explicitly.
    return Qwen3Config(**_decoder_kwargs(vocab, layers, ids), tie_word_embeddings=True, use_sliding_window=False)


def mistral_config(vocab, layers, window, ids):
    from transformers import MistralConfig

    return MistralConfig(**_decoder_kwargs(vocab, layers, ids), sliding_window=window, tie_word_embeddings=False)


def gemma3_config(vocab, layers, window, ids):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **_decoder_kwargs(vocab, layers, ids),
        sliding_window=window,
        layer_types=gemma3_layer_types(layers),
        # Real Gemma 3 scales queries by head_dim**-0.5; the default (256) assumes the big head_dim.
        query_pre_attn_scalar=HEAD_DIM,
        tie_word_embeddings=True,
    )


def gpt2_config(vocab, layers, window, ids):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=vocab,
        n_positions=MAX_POSITIONS,
        n_embd=HIDDEN,
        n_layer=layers,
        n_head=HEADS,
        n_inner=INTERMEDIATE,
        tie_word_embeddings=True,
        **ids,
    )


def family_config(class_name: str, *, drop: tuple[str, ...] = (), llama_style: bool = True, **extra):
    """A make_config for a family whose config takes the Llama-style kwargs (minus `drop`) plus `extra`."""

    def make(vocab, layers, window, ids):
        import transformers

        kwargs = _decoder_kwargs(vocab, layers, ids) if llama_style else dict(vocab_size=vocab, **ids)
        for name in drop:
            kwargs.pop(name, None)
        kwargs.update({k: (v(layers, window) if callable(v) else v) for k, v in extra.items()})
        return getattr(transformers, class_name)(**kwargs)

    return make


def alternating(full_every: int, sliding: str = "sliding_attention", full: str = "full_attention"):
    """layer_types with every `full_every`-th layer (and the last) full, the rest `sliding`."""
    return lambda layers, window: [
        full if (i + 1) % full_every == 0 or i == layers - 1 else sliding for i in range(layers)
    ]


def gemma3_mm_config(vocab, layers, window, ids):
    """Gemma3ForConditionalGeneration: the Gemma 3 text decoder behind a tiny SigLIP vision tower."""
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    ids = dict(ids)
    image = {name: ids.pop(name) for name in ("image_token_id", "boi_token_id", "eoi_token_id")}
    text = Gemma3TextConfig(
        **_decoder_kwargs(vocab, layers, ids),
        sliding_window=window,
        layer_types=gemma3_layer_types(layers),
        query_pre_attn_scalar=HEAD_DIM,
        tie_word_embeddings=True,
    )
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=4
    )
    return Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=image["image_token_id"],
        boi_token_index=image["boi_token_id"],
        eoi_token_index=image["eoi_token_id"],
        tie_word_embeddings=True,
        **ids,
    )


def _decoder_kwargs(vocab, layers, ids):
    """Config kwargs shared by the Llama-style decoders (RoPE, RMSNorm, GQA)."""
    return dict(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        **ids,
    )


def gemma3_layer_types(layers: int) -> list[str]:
    """Gemma 3 interleaves sliding and full layers; here every 4th layer and the last are full."""
    return ["full_attention" if (i + 1) % 4 == 0 or i == layers - 1 else "sliding_attention" for i in range(layers)]


def given_layers(layers, window):
    """An `extra` of `family_config` that is the layer count asked for (configs without Llama's names)."""
    return layers


MOE: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

"""The tiny architectures: per family its special tokens, chat template, tokenizer habits and model config
(``SPECS``), and the families the `kvtui tiny` command and the architecture matrix build."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .tiny_configs import (
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTERMEDIATE,
    KV_HEADS,
    MAX_POSITIONS,
    MOE,
    alternating,
    family_config,
    gemma3_config,
    gemma3_mm_config,
    given_layers,
    gpt2_config,
    llama_config,
    mistral_config,
    qwen2_config,
    qwen3_config,
)
from .tiny_templates import CHATML_TEMPLATE, GEMMA_TEMPLATE, LLAMA_TEMPLATE, MISTRAL_TEMPLATE, QWEN2_TEMPLATE

ARCHES = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "gpt2")
# Every family the architecture matrix builds (tests/engine/reading/test_arch_matrix.py); ARCHES are the
# ones the `kvtui tiny` command offers.
MATRIX_ARCHES = ARCHES + (
    "qwen3_moe",
    "mixtral",
    "gemma",
    "gemma2",
    "gemma3_mm",
    "phi3",
    "gpt_neox",
    "opt",
    "falcon",
    "stablelm",
    "starcoder2",
    "olmo2",
    "cohere",
    "granite",
    "deepseek_v3",
    "gpt_oss",
    "smollm3",
    "qwen3_next",
    "lfm2",
    "falcon_h1",
    "jamba",
)


@dataclass(frozen=True)
class ArchSpec:
    """How one architecture names its special tokens, templates chats and is configured."""

    specials: tuple[str, ...]  # every special token, in vocab order (ids 0..n-1)
    bos: str
    eos: str
    pad: str
    unk: str | None
    eot: str  # end-of-turn token, added to generation_config.eos_token_id
    template: str
    default_bos: bool  # does the family's tokenizer add BOS on encode?
    default_layers: int
    default_window: int | None  # None: the arch has no sliding-window attention
    make_config: Callable[..., object]  # (vocab_size, layers, window, ids) -> model config
    pretokenize_regex: str | None = None  # None: plain GPT-2 style ByteLevel pre-tokenizer


_CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Qwen's split (digits one at a time). transformers 5.x loads model_type "qwen2" with
# Qwen2Tokenizer whatever tokenizer_config.json says, and that class rebuilds NFC + this
# split instead of reading tokenizer.json's pipeline, so ours must match it exactly.
QWEN_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

SPECS: dict[str, ArchSpec] = {
    "llama": ArchSpec(
        specials=("<unk>", "<s>", "</s>", "<pad>", "<|start|>", "<|end|>"),
        bos="<s>",
        eos="</s>",
        pad="<pad>",
        unk="<unk>",
        eot="<|end|>",
        template=LLAMA_TEMPLATE,
        default_bos=True,
        default_layers=2,
        default_window=None,
        make_config=llama_config,
    ),
    "qwen2": ArchSpec(
        specials=_CHATML,
        bos="<|endoftext|>",
        eos="<|im_end|>",
        pad="<|endoftext|>",
        unk=None,
        eot="<|im_end|>",
        template=QWEN2_TEMPLATE,
        default_bos=False,
        default_layers=2,
        default_window=None,
        make_config=qwen2_config,
        pretokenize_regex=QWEN_PRETOKENIZE_REGEX,
    ),
    "qwen3": ArchSpec(
        specials=_CHATML,
        bos="<|endoftext|>",
        eos="<|im_end|>",
        pad="<|endoftext|>",
        unk=None,
        eot="<|im_end|>",
        template=CHATML_TEMPLATE,
        default_bos=False,
        default_layers=2,
        default_window=None,
        make_config=qwen3_config,
        pretokenize_regex=QWEN_PRETOKENIZE_REGEX,
    ),
    "mistral": ArchSpec(
        specials=("<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]"),
        bos="<s>",
        eos="</s>",
        pad="<pad>",
        unk="<unk>",
        eot="</s>",
        template=MISTRAL_TEMPLATE,
        default_bos=True,
        default_layers=2,
        default_window=8,
        make_config=mistral_config,
    ),
    "gemma3": ArchSpec(
        specials=("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
        bos="<bos>",
        eos="<eos>",
        pad="<pad>",
        unk="<unk>",
        eot="<end_of_turn>",
        template=GEMMA_TEMPLATE,
        default_bos=False,
        default_layers=4,
        default_window=8,
        make_config=gemma3_config,
    ),
    "gpt2": ArchSpec(
        specials=_CHATML,
        bos="<|endoftext|>",
        eos="<|endoftext|>",
        pad="<|endoftext|>",
        unk="<|endoftext|>",
        eot="<|im_end|>",
        template=CHATML_TEMPLATE,
        default_bos=False,
        default_layers=2,
        default_window=None,
        make_config=gpt2_config,
    ),
}

_GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")


def _chatml(make_config, **fields) -> ArchSpec:
    """A family tokenized the Qwen way (ChatML, no BOS added): the template is what matters to the cache."""
    defaults = dict(
        specials=_CHATML,
        bos="<|endoftext|>",
        eos="<|im_end|>",
        pad="<|endoftext|>",
        unk=None,
        eot="<|im_end|>",
        template=CHATML_TEMPLATE,
        default_bos=False,
        default_layers=2,
        default_window=None,
        make_config=make_config,
    )
    return ArchSpec(**{**defaults, **fields})


def _gemma(make_config, **fields) -> ArchSpec:
    defaults = dict(
        specials=_GEMMA_SPECIALS,
        bos="<bos>",
        eos="<eos>",
        pad="<pad>",
        unk="<unk>",
        eot="<end_of_turn>",
        template=GEMMA_TEMPLATE,
        default_bos=False,
        default_layers=2,
        default_window=None,
        make_config=make_config,
    )
    return ArchSpec(**{**defaults, **fields})


SPECS.update(
    {
        "qwen3_moe": _chatml(
            family_config("Qwen3MoeConfig", **MOE, tie_word_embeddings=True), pretokenize_regex=QWEN_PRETOKENIZE_REGEX
        ),
        "mixtral": _chatml(
            family_config(
                "MixtralConfig",
                num_local_experts=4,
                num_experts_per_tok=2,
                sliding_window=lambda layers, window: window,
                tie_word_embeddings=False,
            ),
            default_window=8,
        ),
        "gemma": _gemma(family_config("GemmaConfig", tie_word_embeddings=True)),
        "gemma2": _gemma(
            family_config(
                "Gemma2Config",
                sliding_window=lambda layers, window: window,
                layer_types=alternating(2),
                query_pre_attn_scalar=HEAD_DIM,
                tie_word_embeddings=True,
            ),
            default_window=8,
        ),
        "gemma3_mm": _gemma(
            gemma3_mm_config,
            default_window=8,
            specials=_GEMMA_SPECIALS + ("<start_of_image>", "<end_of_image>", "<image_soft_token>"),
        ),
        "phi3": _chatml(family_config("Phi3Config", drop=("head_dim",), tie_word_embeddings=False)),
        "gpt_neox": _chatml(
            family_config(
                "GPTNeoXConfig",
                llama_style=False,
                hidden_size=HIDDEN,
                intermediate_size=INTERMEDIATE,
                num_hidden_layers=given_layers,
                num_attention_heads=HEADS,
                max_position_embeddings=MAX_POSITIONS,
                rotary_pct=0.25,
            )
        ),
        "opt": _chatml(
            family_config(
                "OPTConfig",
                llama_style=False,
                hidden_size=HIDDEN,
                ffn_dim=INTERMEDIATE,
                num_hidden_layers=given_layers,
                num_attention_heads=HEADS,
                max_position_embeddings=MAX_POSITIONS,
                word_embed_proj_dim=HIDDEN,
            )
        ),
        "falcon": _chatml(
            family_config(
                "FalconConfig",
                llama_style=False,
                hidden_size=HIDDEN,
                num_hidden_layers=given_layers,
                num_attention_heads=HEADS,
                num_kv_heads=KV_HEADS,
                new_decoder_architecture=True,
                max_position_embeddings=MAX_POSITIONS,
            )
        ),
        "stablelm": _chatml(family_config("StableLmConfig", drop=("head_dim",), partial_rotary_factor=0.25)),
        "starcoder2": _chatml(
            family_config("Starcoder2Config", drop=("head_dim",), sliding_window=lambda layers, window: window),
            default_window=8,
        ),
        "olmo2": _chatml(family_config("Olmo2Config", drop=("head_dim",))),
        "cohere": _chatml(family_config("CohereConfig", drop=("head_dim",))),
        "granite": _chatml(family_config("GraniteConfig", drop=("head_dim",))),
        "deepseek_v3": _chatml(
            family_config(
                "DeepseekV3Config",
                drop=("head_dim",),
                kv_lora_rank=16,
                q_lora_rank=32,
                qk_rope_head_dim=8,
                qk_nope_head_dim=16,
                v_head_dim=12,
                n_routed_experts=4,
                num_experts_per_tok=2,
                n_group=1,
                topk_group=1,
                moe_intermediate_size=32,
                first_k_dense_replace=1,
                n_shared_experts=1,
                num_key_value_heads=HEADS,
            )
        ),
        "gpt_oss": _chatml(
            family_config(
                "GptOssConfig",
                num_local_experts=4,
                num_experts_per_tok=2,
                sliding_window=lambda layers, window: window,
                layer_types=alternating(2),
            ),
            default_window=8,
        ),
        "smollm3": _chatml(family_config("SmolLM3Config")),
        "qwen3_next": _chatml(
            family_config(
                "Qwen3NextConfig",
                **MOE,
                shared_expert_intermediate_size=32,
                linear_conv_kernel_dim=4,
                linear_key_head_dim=16,
                linear_value_head_dim=16,
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                layer_types=alternating(2, sliding="linear_attention"),
            ),
            pretokenize_regex=QWEN_PRETOKENIZE_REGEX,
        ),
        "lfm2": _chatml(
            family_config("Lfm2Config", drop=("head_dim",), conv_L_cache=3, layer_types=alternating(2, sliding="conv"))
        ),
        "falcon_h1": _chatml(
            family_config(
                "FalconH1Config",
                mamba_d_ssm=64,
                mamba_n_heads=4,
                mamba_d_head=16,
                mamba_n_groups=1,
                mamba_d_state=8,
                mamba_d_conv=4,
                mamba_expand=1,
                mamba_chunk_size=16,
            )
        ),
        "jamba": _chatml(
            family_config(
                "JambaConfig",
                drop=("head_dim",),
                num_experts=1,
                num_experts_per_tok=1,
                attn_layer_period=2,
                attn_layer_offset=1,
                expert_layer_period=2,
                expert_layer_offset=1,
                use_mamba_kernels=False,
                mamba_d_state=8,
                mamba_d_conv=4,
                mamba_expand=1,
            )
        ),
    }
)

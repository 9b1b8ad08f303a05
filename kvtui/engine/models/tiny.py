"""Tiny random causal LMs with a real tokenizer and chat template, built offline.

``build_tiny(arch, out_dir)`` writes a directory that loads with
``AutoTokenizer.from_pretrained`` and ``AutoModelForCausalLM.from_pretrained``,
so tests and demos can exercise the real loading, templating and caching code
paths of several architectures without downloading anything. The weights are
random (seeded) and the output is gibberish; only shapes and plumbing matter.

Per-arch token conventions follow the real model families closely enough to
reproduce their pitfalls: Llama/Mistral tokenizers add BOS themselves, Gemma's
template writes BOS (so tokenizing the rendered text with special tokens gives
a double BOS), Qwen adds none, and ``eos=True`` appends EOS to every encode.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

# Model dimensions shared by every arch: small enough to build in well under a second.
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 128
MAX_POSITIONS = 4096
VOCAB_TARGET = 512

# Fixed training corpus: the tokenizer (and so the vocab size) must be reproducible.
CORPUS = [
    "Let's start by defining a variable k equal to 5. What is k?",
    "The variable k is equal to 5.",
    "Now multiply k by 3. What is k multiplied by 3?",
    "k multiplied by 3 is equal to 15.",
    "What is 12 plus 30? The answer is 42.",
    "Define a variable x equal to 7, and a variable y equal to 9.",
    "What is x multiplied by y? It is 63.",
    "Is 100 divided by 4 equal to 25? Yes, it is.",
    "Hello! How are you today?",
    "I am fine, thank you. How can I help you?",
    "Please tell me a short story about a cat.",
    "Once upon a time, a small cat lived in a quiet house.",
    "The cat liked to sleep in the sun, near the window.",
    "What is the capital of France? The capital of France is Paris.",
    "Count from 0 to 9: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9.",
    "The year 2024 had 366 days; the year 2023 had 365.",
    "You are a helpful assistant.",
    "Answer the question, then explain your reasoning step by step.",
    "A key and a value are stored for every token in the cache.",
    "The attention layer reads the keys and values of earlier tokens.",
    "Sliding window attention only keeps the most recent tokens.",
    "Summarize the text above in one sentence, please.",
    "def add(a, b): return a + b  # a simple function",
    "print(\"hello world\")  [1, 2, 3] {'k': 5} (x + y) * 2 = z",
    "Email me at test@example.com or call 555-0123 at 10:30 am.",
    "Prices went up by 3.5% in March, and by 2.1% in April.",
    "Why is the sky blue? Because air scatters blue light more than red light.",
    "What is k plus k? It is 10, since k is equal to 5.",
    "Now set k equal to k multiplied by k. What is k now?",
    "k is now equal to 25.",
    "Thanks! That was very helpful. Goodbye.",
    "The quick brown fox jumps over the lazy dog.",
    'She said: "I will be there at 8 o\'clock, I promise."',
    "Is it true that 2 + 2 = 4? Yes; it is always true.",
    "Write a list: first, second, third, and last.",
    "Remember the variable k. We will use it again later.",
]


# Chat templates. Each mimics its family closely enough to reproduce the family's
# BOS/EOS behaviour; ``{{ bos_token }}`` appears only where the real one writes it.
LLAMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start|>' + message['role'] + '\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant\\n' }}{% endif %}"
)

# ChatML. Qwen2 injects a default system prompt like the real Qwen2 template; Qwen3 does not.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
QWEN2_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}" + CHATML_TEMPLATE
)

# Mistral: no system role, so a leading system message is folded into the first [INST].
MISTRAL_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] + '\\n\\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set loop_messages = messages %}{% endif %}"
    "{{ bos_token }}"
    "{% for message in loop_messages %}"
    "{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported') }}"
    "{% endif %}"
    "{% endfor %}"
)

# Gemma writes BOS itself and calls the assistant "model".
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] + '\\n\\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '')"
    " + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
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


def _llama_config(vocab, layers, window, ids):
    from transformers import LlamaConfig

    return LlamaConfig(**_decoder_kwargs(vocab, layers, ids), tie_word_embeddings=False)


def _qwen2_config(vocab, layers, window, ids):
    from transformers import Qwen2Config

    # Qwen2 derives head_dim from hidden/heads; small Qwen2 checkpoints tie embeddings.
    kwargs = _decoder_kwargs(vocab, layers, ids)
    kwargs.pop("head_dim")
    return Qwen2Config(**kwargs, tie_word_embeddings=True, use_sliding_window=False)


def _qwen3_config(vocab, layers, window, ids):
    from transformers import Qwen3Config

    # Qwen3Config defaults head_dim to 128, so it must be passed explicitly.
    return Qwen3Config(**_decoder_kwargs(vocab, layers, ids), tie_word_embeddings=True, use_sliding_window=False)


def _mistral_config(vocab, layers, window, ids):
    from transformers import MistralConfig

    return MistralConfig(**_decoder_kwargs(vocab, layers, ids), sliding_window=window, tie_word_embeddings=False)


def _gemma3_config(vocab, layers, window, ids):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **_decoder_kwargs(vocab, layers, ids),
        sliding_window=window,
        layer_types=gemma3_layer_types(layers),
        # Real Gemma 3 scales queries by head_dim**-0.5; the default (256) assumes the big head_dim.
        query_pre_attn_scalar=HEAD_DIM,
        tie_word_embeddings=True,
    )


def _gpt2_config(vocab, layers, window, ids):
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


def _family_config(class_name: str, *, drop: tuple[str, ...] = (), llama_style: bool = True, **extra):
    """A make_config for a family whose config takes the Llama-style kwargs (minus `drop`) plus `extra`."""

    def make(vocab, layers, window, ids):
        import transformers

        kwargs = _decoder_kwargs(vocab, layers, ids) if llama_style else dict(vocab_size=vocab, **ids)
        for name in drop:
            kwargs.pop(name, None)
        kwargs.update({k: (v(layers, window) if callable(v) else v) for k, v in extra.items()})
        return getattr(transformers, class_name)(**kwargs)

    return make


def _alternating(full_every: int, sliding: str = "sliding_attention", full: str = "full_attention"):
    """layer_types with every `full_every`-th layer (and the last) full, the rest `sliding`."""
    return lambda layers, window: [
        full if (i + 1) % full_every == 0 or i == layers - 1 else sliding for i in range(layers)
    ]


def _gemma3_mm_config(vocab, layers, window, ids):
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
        make_config=_llama_config,
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
        make_config=_qwen2_config,
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
        make_config=_qwen3_config,
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
        make_config=_mistral_config,
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
        make_config=_gemma3_config,
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
        make_config=_gpt2_config,
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


def _LAYERS(layers, window):
    return layers


_MOE: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

SPECS.update(
    {
        "qwen3_moe": _chatml(
            _family_config("Qwen3MoeConfig", **_MOE, tie_word_embeddings=True), pretokenize_regex=QWEN_PRETOKENIZE_REGEX
        ),
        "mixtral": _chatml(
            _family_config(
                "MixtralConfig",
                num_local_experts=4,
                num_experts_per_tok=2,
                sliding_window=lambda layers, window: window,
                tie_word_embeddings=False,
            ),
            default_window=8,
        ),
        "gemma": _gemma(_family_config("GemmaConfig", tie_word_embeddings=True)),
        "gemma2": _gemma(
            _family_config(
                "Gemma2Config",
                sliding_window=lambda layers, window: window,
                layer_types=_alternating(2),
                query_pre_attn_scalar=HEAD_DIM,
                tie_word_embeddings=True,
            ),
            default_window=8,
        ),
        "gemma3_mm": _gemma(
            _gemma3_mm_config,
            default_window=8,
            specials=_GEMMA_SPECIALS + ("<start_of_image>", "<end_of_image>", "<image_soft_token>"),
        ),
        "phi3": _chatml(_family_config("Phi3Config", drop=("head_dim",), tie_word_embeddings=False)),
        "gpt_neox": _chatml(
            _family_config(
                "GPTNeoXConfig",
                llama_style=False,
                hidden_size=HIDDEN,
                intermediate_size=INTERMEDIATE,
                num_hidden_layers=_LAYERS,
                num_attention_heads=HEADS,
                max_position_embeddings=MAX_POSITIONS,
                rotary_pct=0.25,
            )
        ),
        "opt": _chatml(
            _family_config(
                "OPTConfig",
                llama_style=False,
                hidden_size=HIDDEN,
                ffn_dim=INTERMEDIATE,
                num_hidden_layers=_LAYERS,
                num_attention_heads=HEADS,
                max_position_embeddings=MAX_POSITIONS,
                word_embed_proj_dim=HIDDEN,
            )
        ),
        "falcon": _chatml(
            _family_config(
                "FalconConfig",
                llama_style=False,
                hidden_size=HIDDEN,
                num_hidden_layers=_LAYERS,
                num_attention_heads=HEADS,
                num_kv_heads=KV_HEADS,
                new_decoder_architecture=True,
                max_position_embeddings=MAX_POSITIONS,
            )
        ),
        "stablelm": _chatml(_family_config("StableLmConfig", drop=("head_dim",), partial_rotary_factor=0.25)),
        "starcoder2": _chatml(
            _family_config("Starcoder2Config", drop=("head_dim",), sliding_window=lambda layers, window: window),
            default_window=8,
        ),
        "olmo2": _chatml(_family_config("Olmo2Config", drop=("head_dim",))),
        "cohere": _chatml(_family_config("CohereConfig", drop=("head_dim",))),
        "granite": _chatml(_family_config("GraniteConfig", drop=("head_dim",))),
        "deepseek_v3": _chatml(
            _family_config(
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
            _family_config(
                "GptOssConfig",
                num_local_experts=4,
                num_experts_per_tok=2,
                sliding_window=lambda layers, window: window,
                layer_types=_alternating(2),
            ),
            default_window=8,
        ),
        "smollm3": _chatml(_family_config("SmolLM3Config")),
        "qwen3_next": _chatml(
            _family_config(
                "Qwen3NextConfig",
                **_MOE,
                shared_expert_intermediate_size=32,
                linear_conv_kernel_dim=4,
                linear_key_head_dim=16,
                linear_value_head_dim=16,
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                layer_types=_alternating(2, sliding="linear_attention"),
            ),
            pretokenize_regex=QWEN_PRETOKENIZE_REGEX,
        ),
        "lfm2": _chatml(
            _family_config(
                "Lfm2Config", drop=("head_dim",), conv_L_cache=3, layer_types=_alternating(2, sliding="conv")
            )
        ),
        "falcon_h1": _chatml(
            _family_config(
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
            _family_config(
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


# Named alternative templates, for reproducing template pitfalls (`template="counter"`).
NAMED_TEMPLATES = {
    # Stamps the message count into the first message, the way templates that print today's date
    # re-render earlier turns: the cached prefix no longer matches the next rendering.
    "counter": (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if loop.first %}[{{ messages|length }} messages] "
        "{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
}


def build_tiny(
    arch: str,
    out_dir: str | Path,
    *,
    bos: bool | None = None,
    eos: bool = False,
    sliding_window: int | None = None,
    layers: int | None = None,
    seed: int = 0,
    template: str | None = None,
) -> Path:
    """Build a tiny random ``arch`` model plus tokenizer into ``out_dir`` and return its path.

    ``bos``/``eos``: whether plain ``tokenizer(text)`` adds BOS/EOS (``bos=None``: the
    family's own behaviour). ``sliding_window``/``layers``: override the arch defaults;
    a window is only accepted by archs with sliding-window attention (mistral, gemma3).
    ``template``: replace the built-in Jinja chat template.
    """
    spec = SPECS.get(arch)
    if spec is None:
        raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(MATRIX_ARCHES)}")
    if sliding_window is not None:
        if spec.default_window is None:
            raise ValueError(
                f"arch {arch!r} has no sliding-window attention; "
                "sliding_window is only supported for "
                + ", ".join(a for a in MATRIX_ARCHES if SPECS[a].default_window is not None)
            )
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    layers = spec.default_layers if layers is None else layers
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _build_tokenizer(
        spec,
        add_bos=spec.default_bos if bos is None else bos,
        add_eos=eos,
        template=spec.template if template is None else NAMED_TEMPLATES.get(template, template),
    )
    _save_tokenizer(tok, out)
    window = spec.default_window if sliding_window is None else sliding_window
    _build_model(spec, tok, layers=layers, window=window, seed=seed, out=out)
    return out


def _build_tokenizer(spec: ArchSpec, *, add_bos: bool, add_eos: bool, template: str):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    if spec.pretokenize_regex is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(spec.pretokenize_regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET,
        special_tokens=list(spec.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any byte stays encodable
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    backend.post_processor = _post_processor(backend, spec, add_bos=add_bos, add_eos=add_eos)

    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=spec.bos,
        eos_token=spec.eos,
        pad_token=spec.pad,
        unk_token=spec.unk,
        # Recorded so transformers 5.x, which rebuilds the post-processor from these
        # flags when they are present, agrees with the one set above.
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        # Decoder-only models take no token_type_ids; 4.57 returns them unless told the model's inputs.
        model_input_names=["input_ids", "attention_mask"],
    )
    tok.chat_template = template
    return tok


def _post_processor(backend, spec: ArchSpec, *, add_bos: bool, add_eos: bool):
    """TemplateProcessing in the same shape transformers' own update_post_processor writes."""
    from tokenizers import processors

    def side(type_id: int, part: str) -> str:
        pieces = [f"{spec.bos}:{type_id}"] if add_bos else []
        pieces.append(f"{part}:{type_id}")
        if add_eos:
            pieces.append(f"{spec.eos}:{type_id}")
        return " ".join(pieces)

    used = dict.fromkeys(([spec.bos] if add_bos else []) + ([spec.eos] if add_eos else []))
    return processors.TemplateProcessing(
        single=side(0, "$A"),
        pair=f"{side(0, '$A')} {side(1, '$B')}",
        special_tokens=[(t, backend.token_to_id(t)) for t in used],  # deduped: gpt2 bos == eos
    )


def _save_tokenizer(tok, out: Path) -> None:
    tok.save_pretrained(out)
    # transformers 5.x records "TokenizersBackend", a class 4.x does not know; the
    # 4.x name still resolves to the same generic tokenizer on 5.x.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["model_input_names"] = ["input_ids", "attention_mask"]
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _build_model(spec: ArchSpec, tok, *, layers: int, window: int | None, seed: int, out: Path):
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    ids = dict(
        bos_token_id=tok.convert_tokens_to_ids(spec.bos),
        eos_token_id=tok.convert_tokens_to_ids(spec.eos),
        pad_token_id=tok.convert_tokens_to_ids(spec.pad),
    )
    if "<image_soft_token>" in spec.specials:  # multimodal: the config names its image tokens
        ids.update(
            image_token_id=tok.convert_tokens_to_ids("<image_soft_token>"),
            boi_token_id=tok.convert_tokens_to_ids("<start_of_image>"),
            eoi_token_id=tok.convert_tokens_to_ids("<end_of_image>"),
        )
    bos_eos_pad = {k: ids[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    cfg = spec.make_config(len(tok), layers, window, ids)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.float32).eval()

    # Stop on the end-of-turn token too, like instruct checkpoints do.
    ids = bos_eos_pad
    eos_ids = [ids["eos_token_id"]]
    eot_id = tok.convert_tokens_to_ids(spec.eot)
    if eot_id not in eos_ids:
        eos_ids.append(eot_id)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["bos_token_id"], eos_token_id=eos_ids, pad_token_id=ids["pad_token_id"]
    )
    model.save_pretrained(out)

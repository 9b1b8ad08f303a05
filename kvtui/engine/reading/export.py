"""Save a session's KV cache at the current step as safetensors, and load it back for inspection.

File layout (schema "kvtui-cache-1"):

- tensors `layers.{i}.keys` and `layers.{i}.values`, [batch, kv_heads, filled, head_dim]: only the
  slots that hold real states. Slot j of layer i holds the state of buffer token `held_from + j`
  (a full layer holds every token, a static one its first `filled` slots, a sliding one its window).
- metadata (safetensors metadata is str -> str): every value is a JSON document --
  `schema`, `kvtui`, `transformers`, `torch`, `model_class`, `model`, `dtype`, `device`, `cache`,
  `capacity`, `step`, `cursor`, `cache_seq_length`, `layers` (per layer: index, kind, filled,
  seen, held_from, window, capacity, slots, k_shape, v_shape), `tokens` (the token buffer: position,
  id, piece, special, origin, turn), `positions` and `bytes` (`{"id": "hex"}`: the bytes of the tokens whose
  piece is not their bytes, a character split across tokens; `CacheExport.text()` rebuilds the text with them).

Export copies (contiguous CPU tensors); inspection never does. The file is written to a temporary
file in the same directory and moved into place with `os.replace`, so a reader never sees a partial
export and a failed export leaves nothing behind. No UI library is imported here.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..records.codec import to_record
from ..records.token_bytes import bytes_record, learn_bytes, run_text
from . import introspect

SCHEMA = "kvtui-cache-1"


class ExportError(Exception):
    """An export that could not be written or read back: names the path."""


@dataclass
class CacheExport:
    keys: list[torch.Tensor]  # per layer, [batch, kv_heads, filled, head_dim]
    values: list[torch.Tensor]
    tokens: list[dict]  # the token buffer: position, id, piece, special, origin, turn
    layers: list[dict]  # per layer: index, kind, filled, seen, held_from, window, capacity, ...
    meta: dict = field(default_factory=dict)  # every metadata field, decoded

    @property
    def token_ids(self) -> list[int]:
        return [t["id"] for t in self.tokens]

    @property
    def positions(self) -> list[int]:
        return list(self.meta.get("positions") or [t["position"] for t in self.tokens])

    def text(self) -> str:
        """The text the cache holds, rebuilt from its tokens' bytes (an export without `bytes`: its pieces)."""
        table: dict[int, bytes] = {}
        learn_bytes(self.meta.get("bytes"), table)
        return run_text(((t["id"], t["piece"]) for t in self.tokens), table)


def export_cache(session, path: str | os.PathLike) -> Path:
    """Write the session's cache, as it is now, to `path` (safetensors); returns the path."""
    path = Path(path)
    if session.cache is None:
        raise ExportError("no cache to export: this session runs with --cache none (every step a full forward)")
    tensors, layers = _layer_tensors(session)
    metadata = _metadata(session, layers)
    _write_atomically(path, tensors, metadata)
    if hasattr(session, "note_export"):
        session.note_export(path)
    return path


def _layer_tensors(session) -> tuple[dict[str, torch.Tensor], list[dict]]:
    cache = session.cache
    infos = introspect.layer_infos(cache, introspect.config_window(session.model.config))
    tensors: dict[str, torch.Tensor] = {}
    layers: list[dict] = []
    for info, layer in zip(infos, cache.layers, strict=True):
        keys: Any = getattr(layer, "keys", None)
        values: Any = getattr(layer, "values", None)
        if keys is not None and keys.dim() == 4 and info.filled > 0:
            # static: [:filled] (the rest is preallocated zeros); full and sliding: every stored slot,
            # which is filled (a static-sliding layer keeps its window in order, oldest first).
            k, v = _copy(keys[:, :, : info.filled]), _copy(values[:, :, : info.filled])
        else:  # a layer not written yet: an empty tensor keeps the layer count
            k, v = torch.empty((0,), dtype=_dtype(session)), torch.empty((0,), dtype=_dtype(session))
        tensors[f"layers.{info.index}.keys"] = k
        tensors[f"layers.{info.index}.values"] = v
        layers.append(
            {
                "index": info.index,
                "kind": info.kind,
                "filled": info.filled,
                "seen": info.seen,
                "held_from": info.held_from,
                "window": info.window,
                "capacity": info.capacity,
                "slots": info.k_shape[-2] if info.k_shape else 0,
                "k_shape": list(k.shape),
                "v_shape": list(v.shape),
                "dtype": str(k.dtype).removeprefix("torch."),
                "device": info.device,
            }
        )
    return tensors, layers


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy with its own storage (a plain tensor, even from inference mode)."""
    with torch.inference_mode(False), torch.no_grad():
        return tensor.detach().to("cpu").clone(memory_format=torch.contiguous_format)


def _dtype(session) -> torch.dtype:
    return getattr(session.model, "dtype", torch.float32)


def _metadata(session, layers: list[dict]) -> dict[str, str]:
    import transformers

    from kvtui._version import __version__

    buffer = session.buffer
    tokens = [to_record(t) for t in buffer]
    config = getattr(session, "config", None)
    values = {
        "schema": SCHEMA,
        "kvtui": __version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "model_class": type(session.model).__name__,
        "model": getattr(session.model.config, "_name_or_path", None),
        "dtype": session.dtype,
        "device": str(getattr(session, "device", "")),
        "cache": getattr(config, "cache", None),
        "capacity": getattr(session, "capacity", None),
        "step": session.steps,
        "last_snapshot_step": session.last.step if session.last is not None else None,
        "cursor": session.cursor,
        "cache_seq_length": session.cache_length,
        "layers": layers,
        "tokens": tokens,
        "positions": [t["position"] for t in tokens],
        "bytes": bytes_record((t.id for t in buffer), getattr(session, "token_bytes", None) or {}),
    }
    return {key: json.dumps(value, ensure_ascii=False, allow_nan=False) for key, value in values.items()}


def _write_atomically(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    tmp: str | None = None
    try:
        for ancestor in (path.parent, *path.parent.parents):  # a regular file in the way: say so
            if ancestor.exists():
                if not ancestor.is_dir():
                    raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(ancestor))
                break
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            raise IsADirectoryError(21, "is a directory")
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        save_file(tensors, tmp, metadata=metadata)
        with open(tmp, "rb") as handle:  # on disk before it gets its name
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if exc.filename and str(exc.filename) not in (str(path), tmp):
            reason += f" ({exc.filename})"
        raise ExportError(f"{path}: cannot write the cache export: {reason}") from exc
    except Exception as exc:  # safetensors reports its own failures as other types
        raise ExportError(f"{path}: cannot write the cache export: {exc}") from exc
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def load_cache(path: str | os.PathLike) -> CacheExport:
    """Read an export back: tensors per layer plus the decoded metadata."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise ExportError(f"{path}: no such cache export")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            raw = handle.metadata() or {}
            names = set(handle.keys())
            tensors = {name: handle.get_tensor(name) for name in names}
    except (SafetensorError, OSError, ValueError) as exc:
        raise ExportError(f"{path}: not a readable safetensors file: {exc}") from exc
    meta = {key: _decode(value) for key, value in raw.items()}
    if meta.get("schema") != SCHEMA:
        raise ExportError(f"{path}: unknown cache export schema {meta.get('schema')!r} (this kvtui reads {SCHEMA})")
    layers = list(meta.get("layers") or [])
    keys, values = [], []
    for layer in layers:
        index = layer["index"]
        try:
            keys.append(tensors[f"layers.{index}.keys"])
            values.append(tensors[f"layers.{index}.values"])
        except KeyError as exc:
            raise ExportError(f"{path}: the export lacks tensor {exc.args[0]}") from None
    return CacheExport(keys=keys, values=values, tokens=list(meta.get("tokens") or []), layers=layers, meta=meta)


def _decode(value: str):
    """kvtui writes JSON; other writers' metadata (e.g. {"format": "pt"}) stays a plain string."""
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def to_dynamic_cache(export: CacheExport, config):
    """A transformers DynamicCache holding the exported states, to continue decoding from them.

    Full and static layers become full layers holding every token; sliding layers keep their held
    window and count every token they were fed (`seen`). Only the layer types the config asks for
    are built, so `config` must be the exporting model's.
    """
    cache = introspect.make_cache("dynamic", config)
    if len(cache.layers) != len(export.layers):
        raise ExportError(f"the config has {len(cache.layers)} cache layers, the export {len(export.layers)}")
    with torch.inference_mode():
        for layer, info, keys, values in zip(cache.layers, export.layers, export.keys, export.values):
            if keys.dim() != 4:
                continue  # never written
            if info["kind"] in ("static", "full") and info["held_from"] != 0:
                raise ExportError(f"layer {info['index']} does not hold every token (held from {info['held_from']})")
            layer.update(keys, values)
            if hasattr(layer, "cumulative_length"):  # sliding layers count tokens, not slots
                layer.cumulative_length = info["seen"]
    return cache

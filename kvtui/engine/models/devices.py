"""Device and dtype resolution: what `--device auto` and `--dtype auto` mean on this machine."""

from __future__ import annotations

import re

import torch
import transformers

from .common import ModelLoadError

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])
DTYPE_KWARG = "dtype" if _TRANSFORMERS_MAJOR >= 5 else "torch_dtype"


def resolve_device(device: str) -> str:
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


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    name = (dtype or "auto").strip().lower()
    if name == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if name in _DTYPES:
        return _DTYPES[name]
    raise ModelLoadError(f"unknown dtype {dtype!r}; use one of: auto, float32 (fp32), bfloat16 (bf16), float16 (fp16)")


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")

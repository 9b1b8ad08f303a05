"""`tiny:ARCH[,key=value...]` model names: a tiny random model built offline once into the cache directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .common import ModelLoadError, Progress, cache_root, quiet_progress_bars, report


def tiny_model_dir(spec: str, progress: Progress | None = None) -> Path:
    """`tiny:ARCH[,key=value...]` (keys: bos, eos, window, layers, seed, template): a tiny random model
    built offline once into the cache directory, so samples can name the pitfall model they need."""
    from .tiny import build_tiny

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
        import os
        import shutil
        import tempfile

        report(progress, f"building tiny model {spec}", None)
        # Built in a temporary sibling and moved into place whole: two processes (xdist workers, a test and
        # its subprocess) asking at once never read a half-written directory.
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            with quiet_progress_bars():  # transformers' "Writing model shards" bar: on a TUI, or before a refusal
                build_tiny(arch, tmp, **kwargs)
            try:
                os.replace(tmp, out)
            except OSError:  # another process got there first (a non-empty directory): keep theirs
                if not (out / "config.json").is_file():
                    raise
        except ValueError as exc:
            raise ModelLoadError(f"{spec}: {exc}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out

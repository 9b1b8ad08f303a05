"""Shared fixtures: tiny offline models (built once per session) and engine sessions on them."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# hqq is installed beside the environment (Makefile: HQQ), for the test processes only: a Python the
# suite starts (a watched program, an engine) does not see it, so does not pay transformers' import of it.
HQQ_PACKAGES = Path(sys.prefix) / "packages-hqq"
if HQQ_PACKAGES.is_dir() and str(HQQ_PACKAGES) not in sys.path:
    sys.path.append(str(HQQ_PACKAGES))

# The embedded SmolLM2 is converted once into this directory, not into the user's real cache;
# it lives under .cache/ so a local re-run of the suite does not convert again. One directory per
# transformers version (make test runs 5.x and 4.57 from one checkout): each converts with its own.
# The conversion is atomic (a temporary sibling moved into place), so xdist workers may race safely.
from importlib.metadata import version as _version  # noqa: E402

os.environ.setdefault("KVTUI_CACHE_DIR", str(ROOT / ".cache" / f"test-models-transformers-{_version('transformers')}"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """tiny_dir(arch, **build_tiny kwargs) -> a directory, built once per distinct request."""
    from kvtui.engine.models.tiny import build_tiny

    built: dict[tuple, Path] = {}

    def make(arch: str, **kwargs) -> Path:
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in built:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            built[key] = build_tiny(arch, out, **kwargs)
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    """tiny_model(arch, **kwargs) -> (model, tokenizer), fp32 CPU, loaded through kvtui's loader."""
    from kvtui.engine.chat.loader import load_model

    loaded: dict[Path, tuple] = {}

    def make(arch: str, **kwargs):
        path = tiny_dir(arch, **kwargs)
        if path not in loaded:
            result = load_model(str(path), dtype="float32", device="cpu")
            loaded[path] = (result.model, result.tokenizer)
        return loaded[path]

    return make


@pytest.fixture
def tiny_loaded(tiny_model):
    """tiny_loaded(arch, **kwargs) -> LoadedModel with a fixed name (stable screenshots), as the app takes it."""
    from kvtui.engine.chat.loader import LoadedModel

    def make(arch: str = "qwen2", **kwargs) -> LoadedModel:
        model, tokenizer = tiny_model(arch, **kwargs)
        return LoadedModel(
            model=model, tokenizer=tokenizer, source=f"tiny-{arch}", path=f"tiny-{arch}", dtype="float32", device="cpu"
        )

    return make


@pytest.fixture
def tp_loop_with():
    """tp_loop_with(code, before): the tp_loop sample's source with `code` (lines) inserted before its line
    `before`, at that line's indent (tests that make a rank misbehave or run forever)."""
    sample = Path(__file__).resolve().parent.parent / "samples" / "programs" / "tp_loop.py"

    def make(code: str, before: str) -> str:
        source = sample.read_text()
        found = re.search(rf"^( *){re.escape(before)}$", source, re.M)
        assert found, f"{before!r} is no longer a line of {sample.name}"
        inserted = "".join(f"{found.group(1)}{line}\n" for line in code.splitlines())
        return source[: found.start()] + inserted + source[found.start() :]

    return make


class _ForkingSubprocess:
    """The subprocess module as kvtui.engine.records.child sees it in a test: Popen forks the engine processes."""

    def __init__(self, popen) -> None:
        self.Popen = popen

    def __getattr__(self, name: str):
        import subprocess

        return getattr(subprocess, name)


@pytest.fixture(autouse=True)
def forked_engines(request, monkeypatch):
    """kvtui's engine processes (one per chat app) forked from a pre-imported Python (tests/plain_python.py), not
    started fresh: ~9 s of CPU importing torch and transformers each under the suite's load. A test marked
    `real_engine` starts real ones, as every test does with KVTUI_TEST_REAL_ENGINES=1."""
    if request.node.get_closest_marker("real_engine") is None and not os.environ.get("KVTUI_TEST_REAL_ENGINES"):
        from plain_python import popen_forking_engines

        import kvtui.engine.records.child as child

        monkeypatch.setattr(child, "subprocess", _ForkingSubprocess(popen_forking_engines))


@pytest.fixture
def plain_python():
    """Pre-imported Pythons (tests/plain_python.py) for the runs of plain-vs-watched tests."""
    from plain_python import pythons

    return pythons()

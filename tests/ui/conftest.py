"""Helpers for driving the real app on a tiny local model."""

from __future__ import annotations

import pytest

from kvtui.engine.loader import LoadedModel


@pytest.fixture
def tiny_loaded(tiny_model):
    """tiny_loaded(arch, **kwargs) -> LoadedModel with a fixed name (stable screenshots)."""

    def make(arch: str = "qwen2", **kwargs) -> LoadedModel:
        model, tokenizer = tiny_model(arch, **kwargs)
        return LoadedModel(model=model, tokenizer=tokenizer, source=f"tiny-{arch}", path=f"tiny-{arch}",
                           dtype="float32", device="cpu")

    return make



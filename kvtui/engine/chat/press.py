"""`--press SPEC`: a kvpress press applied to kvtui's own chat, the way kvpress applies it (`with press(model):`
around the prefill of an empty cache: its hooks compress each layer after attention, during that prefill only),
and what it kept read back from the cache's own tensors with the one reader (`introspect.held.read_kept`).

kvtui's forward hook on each attention module, put before the press's, keeps a reference to the K/V the layer
wrote (what the press is about to compress); after the forward every layer's K/V now is matched against it, so the
held positions come from the cache, not from the press's word. The session decodes afterwards at the logical
positions (the buffer's), with `cache_position` counting the slots the cache holds, as kvpress's pipeline does.

kvpress is imported only here, and only when a press is asked for: its import wraps transformers' attention
functions for the whole process (`kvpress.attention_patch`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..reading.evictions import eviction_notes, held_from_kept
from ..reading.introspect.held import Held, read_kept
from ..records.snapshot import Diagnostic
from .press_spec import INSTALL, PressSpec, kvpress_installed, parse_press
from .session_types import SessionError

MIN_PREFILL = 2  # a prefill of fewer tokens is not compressed (nothing to choose from)


def kvpress_module():
    """kvpress, imported; a SessionError that says how to install it where it is not importable."""
    if not kvpress_installed():
        raise SessionError(f"--press needs kvpress, which is not installed here: {INSTALL}")
    try:
        import kvpress
    except ImportError as exc:
        raise SessionError(f"--press needs kvpress, which is not importable here ({exc}): {INSTALL}") from None
    except Exception as exc:  # noqa: BLE001  kvpress installed beside a transformers it does not support
        raise SessionError(f"--press: kvpress failed to import ({type(exc).__name__}: {exc}): {INSTALL}") from None
    return kvpress


class SessionPress:
    """One press for one session: built from its spec, set up for each prefill it compresses, applied around it."""

    def __init__(self, spec: PressSpec | str, model):
        self.spec = parse_press(spec) if isinstance(spec, str) else spec
        kvpress = kvpress_module()
        cls = getattr(kvpress, self.spec.press_class)
        if self.spec.ratio is not None:
            self.press = cls(compression_ratio=self.spec.ratio)
        else:
            self.press = cls(compression_ratio=0.0, n_sink=self.spec.sinks)
        self.name = self.spec.press_class
        self._layers = _attention_layers(model)

    def prepare(self, n: int) -> bool:
        """Set the press up for a prefill of `n` tokens into an empty cache; False when it would evict nothing."""
        press, spec = self.press, self.spec
        if n < MIN_PREFILL:
            return False
        if spec.kind == "streaming":
            keep = (spec.sinks or 0) + (spec.window or 0)
            if n <= keep:
                return False
            press.compression_ratio = (n - keep - 0.5) / n  # kvpress keeps int(n * (1 - ratio)) = keep
        elif spec.kind in ("snapkv", "tova"):
            press.window_size = max(1, min(64, n // 4))  # kvpress asserts the prompt is longer than its window
        elif spec.kind == "pyramid":  # its budgets need window <= kept / beta (kvpress asserts it)
            press.window_size = max(1, min(64, int(n * (1 - (spec.ratio or 0.0)) / press.beta)))
        return True

    @contextmanager
    def applied(self, model, cache) -> Iterator[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
        """The press's hooks on the model for one forward, and kvtui's before them: {layer: (K, V) as written}."""
        written: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def keep(index: int):
            def hook(module, args, output):
                layer = cache.layers[index]
                written[index] = (layer.keys, layer.values)  # references: the press replaces them, never edits them

            return hook

        handles = [attn.register_forward_hook(keep(i), prepend=True) for i, attn in enumerate(self._layers)]
        try:
            with self.press(model):
                yield written
        finally:
            for handle in handles:
                handle.remove()

    def read(self, written: dict, cache, base: int, n: int, step: int) -> tuple[Held | None, list[Diagnostic]]:
        """After the compressed prefill of `n` tokens at buffer positions base..base+n-1 (into an empty cache): what
        each layer and KV head holds (None: the press kept everything) and the eviction in words."""
        layers = list(cache.layers)
        if len(written) != len(layers) or all(layer.keys is written[i][0] for i, layer in enumerate(layers)):
            return None, []
        fed = list(range(base, base + n))
        sources = [(written[i][0], written[i][1], [fed] * written[i][0].shape[1]) for i in range(len(layers))]
        kept = read_kept(sources, [(layer.keys, layer.values) for layer in layers])
        held = held_from_kept(kept, base + n, f"{self.name} ({self.spec.text}) at step {step}", rerotated=False)
        who = f"--press {self.spec.text}: {self.name}"
        notes = eviction_notes(kept, sources, who, f"kept {{kept}} of {n}", step, "")
        return held, notes


def _attention_layers(model) -> list:
    """Each decoder layer's attention module (where kvpress hooks), as kvpress finds them."""
    inner = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return [layer.self_attn for layer in inner.layers]

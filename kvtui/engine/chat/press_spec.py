"""`--press SPEC`: which kvpress press kvtui's own chat applies, parsed without importing torch or kvpress (the CLI
checks a spec before anything loads; chat/press.py builds the press).

Grammar (one press, no spaces):

    knorm:RATIO       KnormPress: keeps the keys of smallest norm
    snapkv:RATIO      SnapKVPress: keeps what the prompt's last queries attend to (window 64, or a quarter of a
                      shorter prompt)
    pyramid:RATIO     PyramidKVPress: SnapKV with a budget per layer (lower layers keep more)
    expected:RATIO    ExpectedAttentionPress: keeps what future queries are expected to attend to
    tova:RATIO        TOVAPress: keeps what the last query attends to
    streaming:S+W     StreamingLLMPress: the first S tokens (sinks) and the last W of the prefill

RATIO is the fraction of the prefill's tokens the press evicts, 0 < RATIO < 1 (kvpress's `compression_ratio`).
`streaming:S+W` keeps S + W tokens whatever the prefill's length: kvtui sets the press's ratio for each prefill
from its length (nothing evicted when the prefill has S + W tokens or fewer).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

RATIO_PRESSES = {
    "knorm": "KnormPress",
    "snapkv": "SnapKVPress",
    "pyramid": "PyramidKVPress",
    "expected": "ExpectedAttentionPress",
    "tova": "TOVAPress",
}
WINDOW_PRESSES = {"streaming": "StreamingLLMPress"}
GRAMMAR = "knorm:RATIO, snapkv:RATIO, pyramid:RATIO, expected:RATIO, tova:RATIO or streaming:SINKS+WINDOW"
INSTALL = (
    "pip install kvpress==0.5.5 (kvpress pins transformers>=4.56,<5.3: install it in an environment with "
    "transformers 4.57, e.g. pip install 'transformers>=4.57,<4.58' kvpress==0.5.5)"
)


def kvpress_installed() -> bool:
    """Whether kvpress can be imported, without importing it (its import patches transformers' attention functions):
    a real package, not a folder of that name on the path (a namespace package has no origin)."""
    import importlib.util

    spec = importlib.util.find_spec("kvpress")
    return spec is not None and spec.origin is not None


class PressSpecError(ValueError):
    """A --press spec that does not parse: one line naming the grammar."""


@dataclass(frozen=True)
class PressSpec:
    kind: str  # a key of RATIO_PRESSES or WINDOW_PRESSES
    ratio: float | None = None  # the fraction evicted (RATIO_PRESSES)
    sinks: int | None = None  # streaming: tokens kept at the start
    window: int | None = None  # streaming: tokens kept at the end

    @property
    def press_class(self) -> str:
        return {**RATIO_PRESSES, **WINDOW_PRESSES}[self.kind]

    @property
    def text(self) -> str:
        if self.kind in WINDOW_PRESSES:
            return f"{self.kind}:{self.sinks}+{self.window}"
        return f"{self.kind}:{self.ratio:g}"

    def describe(self) -> str:
        if self.kind in WINDOW_PRESSES:
            return f"{self.press_class}(n_sink={self.sinks}, keeps {self.sinks} + {self.window})"
        return f"{self.press_class}(compression_ratio={self.ratio:g})"


def parse_press(text: str) -> PressSpec:
    """`knorm:0.5` -> PressSpec('knorm', ratio=0.5); `streaming:4+64` -> PressSpec('streaming', sinks=4, window=64)."""
    spec = str(text).strip().lower()
    kind, sep, arg = spec.partition(":")
    if not sep or kind not in {**RATIO_PRESSES, **WINDOW_PRESSES}:
        raise PressSpecError(f"unknown press {text!r}: use {GRAMMAR}")
    if kind in WINDOW_PRESSES:
        match = re.fullmatch(r"(\d+)\+(\d+)", arg)
        if not match:
            raise PressSpecError(f"{kind} takes SINKS+WINDOW (two whole numbers, e.g. {kind}:4+64), got {arg!r}")
        sinks, window = int(match[1]), int(match[2])
        if window < 1:
            raise PressSpecError(f"{kind}:{arg}: the window must keep at least 1 token")
        return PressSpec(kind, sinks=sinks, window=window)
    try:
        ratio = float(arg)
    except ValueError:
        raise PressSpecError(f"{kind} takes a RATIO, the fraction evicted (e.g. {kind}:0.5), got {arg!r}") from None
    if not 0 < ratio < 1:
        raise PressSpecError(f"{kind}:{arg}: RATIO is the fraction of the prefill evicted, 0 < RATIO < 1")
    return PressSpec(kind, ratio=ratio)

"""Sampler settings: plain values, importable without torch (the TUI's modal edits them)."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class SamplerSettings:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    repetition_penalty: float = 1.0  # 1 = off
    seed: int | None = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition penalty must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> str:
        if self.greedy:
            parts = ["greedy"]
        else:
            parts = [f"T={self.temperature:g}"]
            if self.top_k:
                parts.append(f"top-k={self.top_k}")
            if self.top_p < 1:
                parts.append(f"top-p={self.top_p:g}")
        if self.repetition_penalty != 1:
            parts.append(f"rep={self.repetition_penalty:g}")
        if not self.greedy and self.seed is not None:
            parts.append(f"seed={self.seed}")
        return " ".join(parts)

    def with_changes(self, **changes) -> SamplerSettings:
        return replace(self, **changes)

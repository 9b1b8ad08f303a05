"""The GPU script (benchmarks/gpu_step_cost.sh and b_step_cost_gpu.py) run end to end on the CPU at toy size.

A lent GPU gives 15 minutes once: the script must not fail on its first line there. This runs the same command
a GPU machine runs (`bash benchmarks/gpu_step_cost.sh`, KVTUI_GPU_SMOKE=1: every row of #43 with its floor, the
models cut to 2 layers, a few steps, torch.compile's backend "eager") from what `--prepare` writes (here into a
temporary directory, KVTUI_GPU_CARRY), and checks what it writes: the raw JSON (every row measured, none failed,
the floor's µs a token beside plain and watched), the GPU.md section and GPU.md with the section first after its
title. Its numbers mean nothing and are not checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = ("tiny llama, 3 layers", "SmolLM2-shaped, 2 layers, bf16, dynamic", "8B-class", "static + compile")


def test_gpu_script_smoke_runs_every_row_and_writes_gpu_md(tmp_path):
    carry, out = tmp_path / "carry", tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "KVTUI_GPU_CARRY": str(carry), "PYTHONPATH": str(ROOT)}
    prepared = subprocess.run(
        [sys.executable, "benchmarks/b_step_cost_gpu.py", "--prepare"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    assert (carry / "transformers.tar.gz").stat().st_size > 1_000_000
    assert (carry / "tokenizer" / "tokenizer.json").exists()
    before = {p.name: p.stat().st_mtime_ns for p in (ROOT / "benchmarks").iterdir() if p.is_file()}

    run = subprocess.run(
        ["bash", "benchmarks/gpu_step_cost.sh"],
        cwd=ROOT,
        env={**env, "KVTUI_GPU_SMOKE": "1", "OUT": str(out), "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    # never over the checkout's benchmarks/ (a smoke run is not a measurement)
    assert {p.name: p.stat().st_mtime_ns for p in (ROOT / "benchmarks").iterdir() if p.is_file()} == before

    result = json.loads((out / "gpu_step_cost.json").read_text())
    assert result["smoke"] is True and result["skipped"] == []
    assert result["device"] == "cpu" and result["card"] == "cpu (no GPU)"
    labels = list(result["ratios"])
    assert len(labels) == len(ROWS) and all(row in label for row, label in zip(ROWS, labels, strict=True))
    for label, ratios in result["ratios"].items():
        assert "error" not in ratios, (label, ratios)
        for name in ("plain_us", "floor_us", "watched_us", "watched_over_floor", "floor_over_plain"):
            assert ratios[name]["median"] > 0, (label, name)
        for kind in ("engine", "watch"):
            parts = result["parts"][f"{kind} · {label}"]
            assert parts["plain_us"] > 0 and "extra_us" in parts, (kind, label)

    section = (out / "gpu_step_cost.md").read_text()
    assert section.startswith("## SMOKE RUN (not a measurement): cpu (no GPU), ")
    assert "KVTUI_GPU_SMOKE=1 bash benchmarks/gpu_step_cost.sh" in section
    table = [line for line in section.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| model | plain µs a token | floor µs | watched µs | kvtui adds")
    for label in labels:
        row = next(line for line in table if line.startswith(f"| {label} |"))
        assert "failed" not in row and row.count("|") == 11
    assert "Per step, part by part" in section

    shipped = (ROOT / "benchmarks" / "GPU.md").read_text()
    title, _, rest = shipped.partition("\n\n")
    assert (out / "GPU.md").read_text() == f"{title}\n\n{section}\n{rest}"
    log = (out / "gpu_step_cost.log").read_text()
    assert "FAILED" not in log and log.count("  ratios: watched/plain") == len(ROWS)

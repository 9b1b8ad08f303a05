#!/usr/bin/env bash
# Section 6b on a lent GPU machine, in one command (from the repository root, benchmarks/.gpu carried: written on
# the CPU machine by `python benchmarks/b_step_cost_gpu.py --prepare`):
#   bash benchmarks/gpu_step_cost.sh [extra b_step_cost_gpu.py arguments]
# It unpacks the tested transformers beside the machine's own (first on PYTHONPATH), runs every row with the floor,
# and writes the raw numbers to $OUT/gpu_step_cost.json (or benchmarks/gpu_step_cost.json without $OUT).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
carry="$here/benchmarks/.gpu"
[ -f "$carry/transformers.tar.gz" ] || { echo "no $carry/transformers.tar.gz: run 'python benchmarks/b_step_cost_gpu.py --prepare' first" >&2; exit 2; }
site=$(mktemp -d)
tar xzf "$carry/transformers.tar.gz" -C "$site"
out="${OUT:-$here/benchmarks}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
PYTHONPATH="$site:$here${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 python "$here/benchmarks/b_step_cost_gpu.py" \
  --tokenizer "$carry/tokenizer" --rows tiny,smol,8b,smol-compile --n 100 --tokens 150 --repeats 5 \
  --compile-mode default --json "$out/gpu_step_cost.json" "$@" 2>&1 | tee "$out/gpu_step_cost.log"

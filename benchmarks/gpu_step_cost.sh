#!/usr/bin/env bash
# Section 6b on a lent GPU machine, in one command (from the repository root, benchmarks/.gpu carried: written on
# the CPU machine by `python benchmarks/b_step_cost_gpu.py --prepare`):
#   bash benchmarks/gpu_step_cost.sh [extra b_step_cost_gpu.py arguments]
# It unpacks the tested transformers beside the machine's own (first on PYTHONPATH), runs every row with the floor
# (no row starts after KVTUI_GPU_BUDGET_S seconds, default 420: the rows run so far are kept), and writes to $OUT (or
# benchmarks/ without $OUT): gpu_step_cost.json (raw), gpu_step_cost.log, gpu_step_cost.md (this run as a GPU.md
# section: the card, versions, commit, command, every number) and GPU.md (benchmarks/GPU.md with that section added:
# copy it over the checkout's). Rows are written as each finishes.
# KVTUI_GPU_SMOKE=1: a check that all of it runs, on the CPU (models cut to 2 layers, the 8B-class narrowed, a few
# steps, torch.compile's backend "eager"), written to $OUT or a temporary directory (never over benchmarks/); make test
# runs it (tests/test_gpu_script.py). It exits non-zero when a row failed (the other rows still run and are written).
# With the device tool: run(command="bash benchmarks/gpu_step_cost.sh", carry=["benchmarks/.gpu"], timeout_s=560);
# on an H100 the rows tiny, smol and 8b take about 5 minutes together, smol-compile what its compiles take.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
carry="${KVTUI_GPU_CARRY:-$here/benchmarks/.gpu}"  # KVTUI_GPU_CARRY: prepared elsewhere (the suite's smoke test)
[ -f "$carry/transformers.tar.gz" ] || { echo "no $carry/transformers.tar.gz: run 'python benchmarks/b_step_cost_gpu.py --prepare' first" >&2; exit 2; }
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
tar xzf "$carry/transformers.tar.gz" -C "$site"
python=${PYTHON:-python}
export KVTUI_GPU_COMMAND="${KVTUI_GPU_SMOKE:+KVTUI_GPU_SMOKE=$KVTUI_GPU_SMOKE }bash benchmarks/gpu_step_cost.sh${*:+ $*}"
if [ "${KVTUI_GPU_SMOKE:-0}" = 1 ]; then
  out="${OUT:-$(mktemp -d)}"
  set -- --smoke "$@"
else
  out="${OUT:-$here/benchmarks}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
fi
PYTHONPATH="$site:$here${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 "$python" "$here/benchmarks/b_step_cost_gpu.py" \
  --tokenizer "$carry/tokenizer" --rows tiny,smol,8b,smol-compile --n 100 --tokens 150 --repeats 5 \
  --compile-mode default --budget-s "${KVTUI_GPU_BUDGET_S:-420}" --json "$out/gpu_step_cost.json" --md-dir "$out" \
  "$@" 2>&1 | tee "$out/gpu_step_cost.log"
echo "written to $out: gpu_step_cost.json gpu_step_cost.log gpu_step_cost.md GPU.md"

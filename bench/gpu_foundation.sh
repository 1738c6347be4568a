#!/usr/bin/env bash
# Issue 2's measurements on the GPU machine, in one call (see BENCHMARKS.md):
#   0. the GPU tests (tests marked `gpu`: no host syncs in the steady state, pinned copies)
#   1. `python -m fasttrain env`
#   2. the step on synthetic data, eager vs compiled (bf16, channels_last, batch 256), side by side
#   3. `python -m fasttrain --compile` on the built-in sample dataset (fresh cache: includes the build)
# Usage there: bash bench/gpu_foundation.sh   (writes logs and summaries under $OUT, or ./gpu-out)
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . > /dev/null  # kernels/ as fasttrain.kernels
export FASTTRAIN_CACHE=/tmp/fasttrain-cache
steps=${SYNTH_STEPS:-300}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw --format=csv | tee "$out/gpu.txt"
python -m fasttrain env 2>&1 | tee "$out/env.txt"
python -m pytest -q -m gpu tests/ 2>&1 | tee "$out/gpu-tests.txt" | tail -3
run() {  # name, then fasttrain flags
  local name=$1; shift
  echo "=== $name: python -m fasttrain $*" | tee -a "$out/log.txt"
  python -m fasttrain --output-dir "/tmp/runs/$name" "$@" 2>&1 | tee -a "$out/log.txt" | tail -4
  python - "$name" >> "$out/summary.txt" <<'PY'
import json, sys
name = sys.argv[1]
s = json.load(open(f"/tmp/runs/{name}/summary.json"))
print(json.dumps({"run": name, **s}))
PY
}
synth=(--loader synthetic --synthetic-steps 1000 --max-steps "$steps" --log-every 20
       --eval-every 0 --batch-size 256 --amp bf16 --channels-last)
run synthetic-eager "${synth[@]}"
run synthetic-compiled "${synth[@]}" --compile
run sample-compiled --compile
git rev-parse --short HEAD 2>/dev/null | sed 's/^/commit /' | tee -a "$out/summary.txt"
cat "$out/summary.txt"

#!/usr/bin/env bash
# The whole pytest-benchmark suite on the GPU machine in one call: step, loaders and kernels.
# Writes bench.json, bench.md (the table) and, where matplotlib is installed, bench.png under $OUT.
# Usage there: bash bench/gpu_suite.sh   (after the DALI stash, for the DALI loader rows)
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
if [ -e /tmp/dali-stash/unpack.sh ]; then source bench/device_env.sh  # our GPU machine
else  # a user's machine: fasttrain installed as the README says
  export PYTHONUNBUFFERED=1
fi
python -m pytest -q -p no:cacheprovider bench/ --benchmark-json "$out/bench.json" \
  --benchmark-columns=median,rounds 2>&1 | tee "$out/bench-log.txt" | tail -20
png=(); python -c "import matplotlib" 2>/dev/null && png=(--png "$out/bench.png")
python bench/report.py "$out/bench.json" "${png[@]}" | tee "$out/bench.md"

#!/usr/bin/env bash
# The DALI loader on the GPU machine, in one call, after the DALI bundle has been stashed there
# (../shared/device/dali-bundle.sh prints the stash calls):
#   the DALI tests; the loader alone vs torchvision; `--loader dali --compile` end to end.
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
bash /tmp/dali-stash/unpack.sh install || exit 1
export PYTHONPATH=/tmp/dali-site:$PWD PYTHONUNBUFFERED=1 FASTTRAIN_CACHE=/tmp/fasttrain-cache
python -m pytest -q -p no:cacheprovider tests/test_dali.py tests/test_gpu.py 2>&1 | tee "$out/tests.txt" | tail -3
python -c "
from fasttrain.config import cache_dir; from fasttrain.data.sample import build_sample
print(build_sample(cache_dir()))" > /tmp/sample_path
python bench/loader_throughput.py "$(tail -1 /tmp/sample_path)" 2>&1 | tee "$out/loaders.txt"
python -m fasttrain --compile --loader dali --output-dir /tmp/runs/sample-dali 2>&1 | tee "$out/e2e.txt" | tail -4
cp /tmp/runs/sample-dali/summary.json "$out/e2e-summary.json" 2>/dev/null

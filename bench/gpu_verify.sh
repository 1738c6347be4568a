#!/usr/bin/env bash
# One call on a two-GPU machine after the DALI stash (../shared/device/dali-bundle.sh prints the
# stash calls). GPU0: bench/dali_e2e.py, where DALI's end-to-end cost goes (pipelines per
# process, executor settings, DALI alone and under GPU load, traces). GPU1: the GPU tests, then
# the kernel microbenchmarks (table and PNG).
# Usage there: bash bench/gpu_verify.sh [collect]   (collect: wait for what is still running)
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
b=/tmp/bench; mkdir -p $b
source bench/device_env.sh
if [ "${1:-}" != collect ]; then
  { git log -1 --format=%h; nvidia-smi --query-gpu=index,name,memory.total --format=csv; nproc; } > $b/machine.txt 2>&1
  python -c "from fasttrain.config import cache_dir; from fasttrain.data.sample import build_sample; build_sample(cache_dir())" > $b/sample.txt 2>&1
  setsid nohup bash -c "CUDA_VISIBLE_DEVICES=0 TRACE_DIR=$b python bench/dali_e2e.py > $b/dali_e2e.txt 2>&1; touch $b/DONE0" > /dev/null 2>&1 < /dev/null &
  setsid nohup bash -c "
    export CUDA_VISIBLE_DEVICES=1
    python -m pytest -q -rA -s -p no:cacheprovider tests/test_gpu.py tests/test_kernels.py > $b/tests.txt 2>&1
    python -m pytest -q -p no:cacheprovider bench/test_kernels.py --benchmark-json $b/kernels.json \
      --benchmark-columns=median,rounds > $b/kernels.txt 2>&1
    png=; python -c 'import matplotlib' 2>/dev/null && png='--png $b/kernels.png'
    python bench/report.py $b/kernels.json \$png > $b/kernels.md 2>&1
    touch $b/DONE1" > /dev/null 2>&1 < /dev/null &
fi
while { [ ! -e $b/DONE0 ] || [ ! -e $b/DONE1 ]; } && [ $SECONDS -lt 550 ]; do sleep 5; done
ls $b; tail -3 $b/tests.txt 2>/dev/null; grep "^|" $b/dali_e2e.txt 2>/dev/null
cat $b/kernels.md 2>/dev/null | head -30
tar -czf "$out/verify.tar.gz" -C /tmp bench

#!/usr/bin/env bash
# DALI's end-to-end cost, two hypotheses side by side on a two-GPU machine (after the DALI stash):
# bench/dali_e2e.py on GPU0 with the driver's default CUDA_DEVICE_MAX_CONNECTIONS=8, and on GPU1
# with 32, fasttrain's default (fewer streams share a hardware queue with the training stream). Inside each, the training stream
# is the default (legacy) stream or a side stream. Usage there: bash bench/gpu_dali_diag.sh
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
b=/tmp/bench; mkdir -p $b/gpu0 $b/gpu1
source bench/device_env.sh
{ git log -1 --format=%h; nvidia-smi --query-gpu=index,name --format=csv; nproc; } > $b/machine.txt 2>&1
python -c "from fasttrain.config import cache_dir; from fasttrain.data.sample import build_sample; build_sample(cache_dir())" > $b/sample.txt 2>&1
CUDA_VISIBLE_DEVICES=0 CUDA_DEVICE_MAX_CONNECTIONS=8 TRACE_DIR=$b/gpu0 python bench/dali_e2e.py > $b/gpu0/dali_e2e.txt 2>&1 &
CUDA_VISIBLE_DEVICES=1 CUDA_DEVICE_MAX_CONNECTIONS=32 TRACE_DIR=$b/gpu1 python bench/dali_e2e.py > $b/gpu1/dali_e2e.txt 2>&1 &
wait
for g in gpu0 gpu1; do echo "== $g"; grep "^|\|compile" $b/$g/dali_e2e.txt; done
tar -czf "$out/diag.tar.gz" -C /tmp bench

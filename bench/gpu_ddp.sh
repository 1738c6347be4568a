#!/usr/bin/env bash
# Issues 3, 4 and 5 on a two-GPU machine after the DALI bundle is stashed, in two back-to-back
# calls. Usage there: bash bench/gpu_ddp.sh c1|c2
#   c1: GPU1: the GPU tests. GPU0: bench/dali_e2e.py (DALI hand-offs against synthetic data, one
#       process). Then DALI end to end, compiled + graphed: 1 GPU, then DDP on 2 GPUs.
#   c2: synthetic scaling 1 -> 2 GPUs (compiled + graphed); DDP under --compile, DDPOptimizer vs
#       compiled autograd; DataParallel vs DDP at the same global batch (eager, as the write-up).
set -uo pipefail
part=${1:?c1 or c2}
out=${OUT:-gpu-out}; mkdir -p "$out"
b=/tmp/bench; mkdir -p $b
source bench/device_env.sh
run() {  # name, then fasttrain flags; skipped when the call's time is nearly spent
  local name=$1; shift
  if [ $SECONDS -gt 480 ]; then echo "{\"run\": \"$name\", \"skipped\": true}" >> $b/summaries.jsonl; return; fi
  echo "=== $name: python -m fasttrain $*" >> $b/runs.txt
  CUDA_VISIBLE_DEVICES=${GPUS:-0,1} python -m fasttrain --output-dir /tmp/runs/$name "$@" >> $b/runs.txt 2>&1
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader >> $b/runs.txt
  summary "$name"
}
synth=(--loader synthetic --synthetic-steps 40 --num-classes 10 --eval-every 0 --config configs/sample.yaml
       --compile-mode default)  # as measured; auto would autotune for synthetic data
if [ "$part" = c1 ]; then
  (CUDA_VISIBLE_DEVICES=1 python -m pytest -q -rA -s -p no:cacheprovider tests/test_gpu.py > $b/tests.txt 2>&1) &
  CUDA_VISIBLE_DEVICES=0 python bench/dali_e2e.py > $b/dali_e2e.txt 2>&1
  wait
  tail -3 $b/tests.txt; grep "^|" $b/dali_e2e.txt
  GPUS=0 run dali-1gpu --compile --cuda-graphs --epochs 10 --eval-every 0
  run dali-ddp2 --nproc-per-node 2 --compile --cuda-graphs --epochs 10 --eval-every 5
else
  GPUS=0 run synth-1gpu "${synth[@]}" --compile --cuda-graphs --epochs 6
  run synth-ddp2 --nproc-per-node 2 "${synth[@]}" --compile --cuda-graphs --epochs 6
  run synth-ddp2-compiled "${synth[@]}" --nproc-per-node 2 --compile --epochs 4
  run synth-ddp2-compiled-autograd "${synth[@]}" --nproc-per-node 2 --compile --ddp-compile compiled-autograd --epochs 4
  run synth-dp-eager "${synth[@]}" --strategy dp --epochs 3
  run synth-ddp2-eager "${synth[@]}" --nproc-per-node 2 --epochs 3
fi
cut -c1-330 $b/summaries.jsonl
tar -czf "$out/bench-$part.tar.gz" -C /tmp bench

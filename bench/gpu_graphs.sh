#!/usr/bin/env bash
# Issues 3 and 4 on a two-GPU machine, in two back-to-back calls, after the DALI bundle is stashed
# (../shared/device/dali-bundle.sh prints the stash calls). Usage there: bash bench/gpu_graphs.sh a|b
#   a: GPU1, in the background (survives the call): the step variants (bench/step_variants.py):
#      max-autotune first, then eager / compiled / graphed at batch 256 and 512, then
#      conv_1x1_as_mm. GPU0: the GPU and DALI tests, then the start-up cost, cold vs warm caches.
#   b: GPU0: end to end on the sample dataset, DALI vs synthetic with the same step, graphed or
#      not; the loader suite (bench/test_loaders.py). Then collects GPU1's results.
set -uo pipefail
part=${1:?a or b}
out=${OUT:-gpu-out}; mkdir -p "$out"
b=/tmp/bench; mkdir -p $b
source bench/device_env.sh
run() {  # name, then fasttrain flags (GPU0); skipped when the call's time is nearly spent
  local name=$1; shift
  if [ $SECONDS -gt 470 ]; then echo "{\"run\": \"$name\", \"skipped\": true}" >> $b/summaries.jsonl; return; fi
  echo "=== $name: python -m fasttrain $*" >> $b/runs.txt
  CUDA_VISIBLE_DEVICES=0 python -m fasttrain --output-dir /tmp/runs/$name "$@" >> $b/runs.txt 2>&1
  summary "$name"
}
synth=(--loader synthetic --synthetic-steps 39 --num-classes 10 --eval-every 0 --config configs/sample.yaml
       --compile-mode default)  # as measured; auto would autotune for synthetic data
if [ "$part" = a ]; then
  { git rev-parse --short HEAD; nvidia-smi --query-gpu=index,name,memory.total,clocks.max.sm --format=csv; nproc; } > $b/machine.txt 2>&1
  setsid nohup bash -c '
    export CUDA_VISIBLE_DEVICES=1
    v() { python bench/step_variants.py --jsonl /tmp/bench/steps.jsonl "$@"; }
    v --batch 256 --kinds compiled+graph --mode max-autotune-no-cudagraphs > /tmp/bench/autotune.md 2>&1
    v --batch 256 512 --kinds eager compiled eager+graph compiled+graph > /tmp/bench/steps.md 2>&1
    v --batch 256 --kinds compiled+graph --options conv_1x1_as_mm > /tmp/bench/options.md 2>&1
    touch /tmp/bench/DONE' > $b/gpu1.log 2>&1 < /dev/null &
  CUDA_VISIBLE_DEVICES=0 python -m pytest -q -rA -s -p no:cacheprovider tests/test_gpu.py tests/test_dali.py > $b/tests.txt 2>&1
  tail -3 $b/tests.txt
  python -c "from fasttrain.config import cache_dir; from fasttrain.data.sample import build_sample; build_sample(cache_dir())" >> $b/runs.txt 2>&1
  # start-up cost: the same config started twice, inductor's caches cold then warm
  export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-startup-test
  run startup-cold "${synth[@]}" --compile --cuda-graphs --epochs 1 --max-steps 20
  run startup-warm "${synth[@]}" --compile --cuda-graphs --epochs 1 --max-steps 20
  unset TORCHINDUCTOR_CACHE_DIR
else
  run e2e-synthetic-graphed "${synth[@]}" --compile --cuda-graphs --epochs 6
  run e2e-dali-graphed-demo --compile --cuda-graphs  # the headline command: sample.yaml, with eval
  run e2e-dali-graphed --compile --cuda-graphs --epochs 6 --eval-every 0
  run e2e-dali-graphed-4threads --compile --cuda-graphs --epochs 6 --eval-every 0 --dali-threads 4
  run e2e-synthetic-compiled "${synth[@]}" --compile --epochs 6
  run e2e-dali-compiled --compile --epochs 6 --eval-every 0
  CUDA_VISIBLE_DEVICES=0 python -m pytest -q -p no:cacheprovider bench/test_loaders.py \
    --benchmark-json $b/loaders.json --benchmark-columns=median,rounds > $b/loaders.txt 2>&1
  while [ ! -e $b/DONE ] && [ $SECONDS -lt 545 ]; do sleep 5; done
fi
cat $b/summaries.jsonl 2>/dev/null | cut -c1-400
tar -czf "$out/bench-$part.tar.gz" -C /tmp bench

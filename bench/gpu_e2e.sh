#!/usr/bin/env bash
# End to end with fasttrain's defaults on a two-GPU machine, after the DALI stash, in two
# back-to-back calls. Usage there: bash bench/gpu_e2e.sh a|b
#   a (background, survives the call): GPU1: the GPU tests, then --batch-size auto on the sample
#     set. GPU0: a 20,000-image sample set, then DALI + compiled + graphed on one GPU. Then both
#     GPUs: the same under DDP, profiled (the 1 -> 2 GPU scaling and the step breakdown).
#   b: DataParallel vs DDP at the same global batch (eager, as the write-up's table), profiled;
#     then collects everything.
set -uo pipefail
part=${1:?a or b}
out=${OUT:-gpu-out}; mkdir -p "$out"
b=/tmp/bench; mkdir -p $b
source bench/device_env.sh
big=/tmp/fasttrain-cache/sample-v1-c10-t2000-v50-s300-480-q90-seed0  # SampleSpec(train_per_class=2000)
synth=(--loader synthetic --synthetic-steps 40 --num-classes 10 --eval-every 0 --config configs/sample.yaml)
if [ "$part" = a ]; then
  echo "$(date -u) commit $(git log -1 --format=%h 2>/dev/null)" > $b/machine.txt
  setsid nohup bash -c '
    CUDA_VISIBLE_DEVICES=1 python -m pytest -q -rA -s -p no:cacheprovider tests/test_gpu.py > $b/tests.txt 2>&1
    run_on auto-batch 1 --batch-size auto --lr 0.02 --compile --cuda-graphs --epochs 3 --eval-every 0
    touch $b/DONE1' > /dev/null 2>&1 < /dev/null &
  setsid nohup bash -c "
    python -c 'from fasttrain.data.sample import SampleSpec, build_sample as b; b(\"/tmp/fasttrain-cache\", SampleSpec(train_per_class=2000))' > $b/sample.txt 2>&1
    run_on dali-1gpu 0 --data $big --compile --compile-mode default --cuda-graphs --epochs 6 --eval-every 0
    while [ ! -e $b/DONE1 ]; do sleep 2; done
    run_on dali-ddp2-profiled 0,1 --data $big --nproc-per-node 2 --compile --compile-mode default --cuda-graphs --epochs 6 \
      --eval-every 0 --profile --profile-wait 40
    touch $b/DONE0" > /dev/null 2>&1 < /dev/null &
  while [ ! -e $b/DONE0 ] && [ $SECONDS -lt 560 ]; do sleep 3; done
else
  while [ ! -e $b/DONE0 ] && [ $SECONDS -lt 300 ]; do sleep 3; done
  run_on dp-eager-profiled 0,1 "${synth[@]}" --strategy dp --epochs 3 --profile --profile-wait 20
  run_on ddp-eager-profiled 0,1 "${synth[@]}" --nproc-per-node 2 --epochs 3 --profile --profile-wait 20
fi
cut -c1-600 $b/summaries.jsonl 2>/dev/null; tail -3 $b/tests.txt 2>/dev/null
tar -czf "$out/e2e-$part.tar.gz" -C /tmp bench --exclude='*.pt.trace.json'
cp -r /tmp/runs/*/profile/breakdown-rank*.json "$out/" 2>/dev/null
for r in /tmp/runs/*/; do n=$(basename $r); mkdir -p $out/runs/$n; cp $r/summary.json $r/log-rank0.txt $r/profile/breakdown-rank*.json $out/runs/$n/ 2>/dev/null; done

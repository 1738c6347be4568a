#!/usr/bin/env bash
# Issue 9 on the four-GPU machine (kind nvidia-h200-x4), in one visit of back-to-back calls
# (docs/GPU-MACHINE.md: a machine idle for 30 s is gone, and with it everything below).
#   call 1, carrying .dali/p0, .dali/w, .dali/unpack.sh:
#       bash .dali/unpack.sh stash > /dev/null && bash bench/gpu_4x.sh a
#   calls 2 and 3, carrying .dali/p1, then .dali/p2:  cp .dali/pN /tmp/dali-stash/
#   call 4, carrying .dali/p3:  cp .dali/p3 /tmp/dali-stash/ && bash bench/gpu_4x.sh b
#   then:  bash bench/gpu_4x.sh w   until it prints "pipe done"
# a: starts `pipe` in the background and returns. b: unpacks DALI, marks it ready for `pipe`,
# then reports as w does. w: waits up to 540 s for `pipe`, prints what it has, and returns the
# logs, summaries and profile breakdowns under $OUT (one tarball, every call).
# pipe, phase 1 (no DALI needed, from call 1 on): builds a 40,000-image sample set
# (SampleSpec(train_per_class=4000): 156 steps per epoch on one GPU, 39 per rank on four); the
# write-up's table on four GPUs, synthetic data, eager, each profiled for 5 steps:
# `--strategy dp` at a global batch of 512 (128 per GPU), then at 1,024 (256 per GPU, DDP-256's
# global batch), `--strategy ddp` at 256 and at 512 per GPU.
# phase 2 (once DALI is ready): the best path, DALI + compile (`default` mode, whose DDP compiles
# fit the visit) + CUDA graphs: 1 GPU, DDP on 2, DDP on 4, DDP on 4 profiled, then 4, 2 and 1
# again (per-GPU scaling against the same call's 1-GPU runs, GPU 0 and GPU 3), and four 1-GPU
# runs at once (each GPU's own pace with the host as loaded as under DDP on four).
# PIPE_LIMIT (default 1,320 s after call 1) stops `pipe` starting runs after that long.
big=/tmp/fasttrain-cache/sample-v1-c10-t4000-v50-s300-480-q90-seed0  # SampleSpec(train_per_class=4000)

report() {
  grep -h -A8 "step time breakdown" $b/runs-*.txt 2>/dev/null | cut -c1-160 | head -80
  cut -c1-400 $b/summaries.jsonl 2>/dev/null
  report_runs x4.tar.gz --exclude='*.pt.trace.json*'
}

source bench/visit.sh
visit "${1:-}" bench/gpu_4x.sh 1320

# ---- pipe: in the background from a; $b/PIPE_DONE at the end ---------------------------------
sample_set 'SampleSpec(train_per_class=4000)'

echo "$SECONDS s: phase 1, the write-up's table (eager, synthetic data, profiled)"
eager=(--config configs/sample.yaml --loader synthetic --synthetic-steps 40 --num-classes 10
       --eval-every 0 --epochs 2 --profile --profile-wait 50)
all=0,1,2,3
go dp-b512 && run_on x4-dp-b512 $all "${eager[@]}" --strategy dp --batch-size 128
go ddp-b256 && run_on x4-ddp-b256 $all "${eager[@]}" --nproc-per-node 4 --batch-size 256
go ddp-b512 && run_on x4-ddp-b512 $all "${eager[@]}" --nproc-per-node 4 --batch-size 512
go dp-b1024 && run_on x4-dp-b1024 $all "${eager[@]}" --strategy dp --batch-size 256

echo "$SECONDS s: waiting for DALI and the sample set"
while { [ ! -e $b/DALI_READY ] || [ ! -e $b/SAMPLE ]; } && [ $SECONDS -lt $limit ]; do
  sleep 3
done
[ -e $b/DALI_READY ] && [ -e $b/SAMPLE ] || { echo "no DALI or no sample set"; touch $b/PIPE_DONE; exit 1; }
tail -1 $b/sample.txt

echo "$SECONDS s: phase 2, the best path: DALI + compile + CUDA graphs, 1 -> 2 -> 4 GPUs"
best=(--config configs/sample.yaml --data $big --compile --compile-mode default --cuda-graphs
      --epochs 6 --eval-every 0)
go 1gpu && run_on x4-best-1gpu 0 "${best[@]}"
go ddp2 && run_on x4-best-ddp2 0,1 "${best[@]}" --nproc-per-node 2
go ddp4 && run_on x4-best-ddp4 $all "${best[@]}" --nproc-per-node 4
go ddp4-profiled && run_on x4-best-ddp4-profiled $all "${best[@]}" --nproc-per-node 4 \
  --profile --profile-wait 60
go ddp4-again && run_on x4-best-ddp4-again $all "${best[@]}" --nproc-per-node 4
go ddp2-again && run_on x4-best-ddp2-again 2,3 "${best[@]}" --nproc-per-node 2
go 1gpu-again && run_on x4-best-1gpu-gpu3 3 "${best[@]}"
if go four-at-once; then
  for g in 0 1 2 3; do run_on x4-best-1gpu-at-once-gpu$g $g "${best[@]}" & done
  wait
fi
echo "$SECONDS s: done"
touch $b/PIPE_DONE

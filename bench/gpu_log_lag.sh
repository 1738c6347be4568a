#!/usr/bin/env bash
# Whether log steps that read the interval before them (the default since `bbd23be`) take back
# the GPU's idle time between steps that the ninth session found beside DALI: 0.4-0.7 ms per step
# on one GPU and 0.9-1.1 under DDP, against 0.06 with synthetic data (BENCHMARKS.md, ninth
# session). `--log-sync` is the old synchronous read, run side by side as the reference.
# Kind nvidia-h200-x2 (the pairs need both GPUs). One visit of back-to-back calls
# (docs/GPU-MACHINE.md):
#   call 1, carrying .dali/p0, .dali/w, .dali/unpack.sh:
#       bash .dali/unpack.sh stash > /dev/null && bash bench/gpu_log_lag.sh a
#   calls 2 and 3, carrying .dali/p1, then .dali/p2:  cp .dali/pN /tmp/dali-stash/
#   call 4, carrying .dali/p3:  cp .dali/p3 /tmp/dali-stash/ && bash bench/gpu_log_lag.sh b
#   then:  bash bench/gpu_log_lag.sh w   until it prints "pipe done"
# pipe, phase 1 (no DALI needed): the 20,000-image sample set; GPU 0 the defaults on synthetic
# data, inductor's caches cold. Phase 2 (DALI ready): a 40-step check of DDP reading late over
# NCCL (eager, synthetic data); GPU 1 the log-step GPU test (its fault path has not run on a GPU),
# then the 1-GPU DDP references
# (`default` mode) while GPU 0 compiles; then the CLI's defaults with DALI side by side on the
# two GPUs and swapped: the default against --log-sync, then DALI against synthetic data; DDP
# with DALI (`default` mode) by default and with --log-sync, twice each; GPU 0's references;
# last, if time is left, DALI's prefetch depth 6 against 4 (the late batches that remain).
# Expected: DALI's cost down from 3.0-3.2% by up to 1% (the between-step idle that log syncs
# cause), DDP's per-GPU scaling up by up to 1%. Sequencing checked with stub commands only.
# PIPE_LIMIT (default 1,260 s after call 1) stops `pipe` starting runs after that long.

report() { report_runs log-lag.tar.gz; }

source bench/visit.sh
visit "${1:-}" bench/gpu_log_lag.sh 1260

# ---- pipe: in the background from a; $b/PIPE_DONE at the end ---------------------------------
# the runs' flags (auto, syn, dali, dflt) are bench/device_env.sh's
echo "$SECONDS s: phase 1: sample set; GPU0 synthetic data, caches cold"
cold_start l-synth-cold-gpu0
echo "$SECONDS s: DALI ready; $(tail -1 $b/sample.txt); DDP reading late over NCCL, a check"
# the late reads' all-reduce and pinned copy have run over NCCL only here: 40 eager steps of DDP
# on synthetic data (beside GPU 0's compile), whose failure shows in the first w call's report
run_on l-ddp-check 0,1 --loader synthetic --synthetic-steps 20 --num-classes 10 --arch resnet18 \
  --image-size 64 --batch-size 64 --epochs 2 --log-every 5 --eval-every 0 --cuda-graphs \
  --nproc-per-node 2
echo "$SECONDS s: GPU1 the log-step GPU test, then the 1-GPU DDP references"
(gpu_tests 1 tests/test_gpu.py -k log_step
 go ref && run_on l-1gpu-gpu1 1 "${dflt[@]}"; go ref && run_on l-1gpu-gpu1-2 1 "${dflt[@]}"
 touch $b/REFS1) &
wait_for $b/SYNTH; wait_for $b/REFS1
echo "$SECONDS s: the defaults with DALI: reading late against --log-sync, then against synthetic"
pair l-dali-late-gpu0 "${dali[@]}" -- l-dali-sync-gpu1 "${dali[@]}" --log-sync
pair l-dali-sync-gpu0 "${dali[@]}" --log-sync -- l-dali-late-gpu1 "${dali[@]}"
pair l-dali-late2-gpu0 "${dali[@]}" -- l-synth-gpu1 "${syn[@]}"
pair l-synth-gpu0 "${syn[@]}" -- l-dali-late2-gpu1 "${dali[@]}"
echo "$SECONDS s: DDP with DALI, default mode"
go ddp && run_on l-ddp2-late 0,1 "${dflt[@]}" --nproc-per-node 2
go ddp && run_on l-ddp2-sync 0,1 "${dflt[@]}" --nproc-per-node 2 --log-sync
go ddp && run_on l-ddp2-sync-2 0,1 "${dflt[@]}" --nproc-per-node 2 --log-sync
go ddp && run_on l-ddp2-late-2 0,1 "${dflt[@]}" --nproc-per-node 2
pair l-1gpu-gpu0 "${dflt[@]}" -- l-1gpu-gpu1-3 "${dflt[@]}"
echo "$SECONDS s: DALI prefetch 6 against 4, if time is left"
pair l-dali-pf6-gpu0 "${dali[@]}" --dali-prefetch 6 -- l-dali-pf4-gpu1 "${dali[@]}"
pair l-dali-pf4-gpu0 "${dali[@]}" -- l-dali-pf6-gpu1 "${dali[@]}" --dali-prefetch 6
echo "$SECONDS s: done"
touch $b/PIPE_DONE

#!/usr/bin/env bash
# What DALI's GPU work beside the step is made of, and whether less of it (--no-dali-antialias:
# the train resize without its antialiasing filter, as in NVIDIA's ResNet-50 reference pipeline)
# takes back part of DALI's cost (issue 3) and of DDP's per-GPU scaling with DALI (issue 5).
# Kind nvidia-h200-x2 if lent, else nvidia-h200: the pipe does what the GPUs it finds allow.
# One visit of back-to-back calls (docs/GPU-MACHINE.md):
#   call 1, carrying .dali/p0, .dali/w, .dali/unpack.sh:
#       bash .dali/unpack.sh stash > /dev/null && bash bench/gpu_dali_work.sh a
#   calls 2 and 3, carrying .dali/p1, then .dali/p2:  cp .dali/pN /tmp/dali-stash/
#   call 4, carrying .dali/p3:  cp .dali/p3 /tmp/dali-stash/ && bash bench/gpu_dali_work.sh b
#   then:  bash bench/gpu_dali_work.sh w   until it prints "pipe done"
# a: starts `pipe` in the background and returns once its first imports are done. b: unpacks
# DALI, marks it ready for `pipe`, then reports as w does. w: waits up to 540 s for `pipe`,
# prints what it has, and returns the logs and summaries under $OUT (one tarball, every call).
# pipe, phase 1 (no DALI needed): the 20,000-image sample set; GPU0 the defaults on synthetic
# data, inductor's caches cold (the tuning is then cached for every later run of that step).
# phase 2 (DALI ready): GPU0 bench/dali_e2e.py --set resize (in one process: synthetic data,
# DALI with and without antialiasing, twice each; then traces of the three, with DALI's GPU work
# listed by kernel). With two GPUs, GPU1 meanwhile runs the `default`-mode 1-GPU references for
# DDP. Then the CLI's defaults end to end: with two GPUs side by side and swapped (DALI with
# against without antialiasing, then without against synthetic data); with one, interleaved.
# Then, with two GPUs, DDP with DALI (`default` mode) with and without antialiasing, twice, and
# GPU0's 1-GPU references.
# Why: the eighth session ruled out stream priority and the SM clock as the cause of DALI's 3%;
# what is left is DALI's own GPU work beside the step, so the lever is doing less of it.
# Ran in the ninth session at `d0d050a` (BENCHMARKS.md); its limit skipped the last DDP run and
# GPU 0's references, which one more call ran by hand. PIPE_LIMIT (default 1,140 s after call 1)
# stops `pipe` starting runs after that long.

report() {
  grep -v "^  tid" $b/resize.txt 2>/dev/null | cut -c1-170
  report_runs dali-work.tar.gz --exclude='bench/*.json'  # not the traces
}

source bench/visit.sh
visit "${1:-}" bench/gpu_dali_work.sh 1140

# ---- pipe: in the background from a; $b/PIPE_DONE at the end ---------------------------------
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
no=(--no-dali-antialias)  # the runs' other flags (auto, syn, dali, dflt) are device_env.sh's

echo "$SECONDS s: $gpus GPU(s); phase 1: sample set; GPU0 synthetic data, caches cold"
cold_start w-synth-cold-gpu0
echo "$SECONDS s: DALI ready; $(tail -1 $b/sample.txt)"
if [ "$gpus" -ge 2 ]; then
  echo "$SECONDS s: GPU1 the 1-GPU DDP references, default mode"
  (go ref && run_on w-1gpu-aa-gpu1 1 "${dflt[@]}"; go ref && run_on w-1gpu-noaa-gpu1 1 "${dflt[@]}" "${no[@]}"
   touch $b/REFS1) &
fi
wait_for $b/SYNTH
echo "$SECONDS s: GPU0 dali_e2e --set resize"
CUDA_VISIBLE_DEVICES=0 TRACE_DIR=$b python bench/dali_e2e.py $set20k --set resize --maxpool --epochs 6 \
  --jsonl $b/resize.jsonl > $b/resize.txt 2>&1
[ "$gpus" -ge 2 ] && wait_for $b/REFS1
echo "$SECONDS s: the defaults end to end"
if [ "$gpus" -ge 2 ]; then
  pair w-dali-aa-gpu0 "${dali[@]}" -- w-dali-noaa-gpu1 "${dali[@]}" "${no[@]}"
  pair w-dali-noaa-gpu0 "${dali[@]}" "${no[@]}" -- w-dali-aa-gpu1 "${dali[@]}"
  pair w-dali-noaa2-gpu0 "${dali[@]}" "${no[@]}" -- w-synth-gpu1 "${syn[@]}"
  pair w-synth-gpu0 "${syn[@]}" -- w-dali-noaa2-gpu1 "${dali[@]}" "${no[@]}"
  echo "$SECONDS s: DDP with DALI, default mode"
  go ddp && run_on w-ddp2-aa 0,1 "${dflt[@]}" --nproc-per-node 2
  go ddp && run_on w-ddp2-noaa 0,1 "${dflt[@]}" --nproc-per-node 2 "${no[@]}"
  go ddp && run_on w-ddp2-noaa-2 0,1 "${dflt[@]}" --nproc-per-node 2 "${no[@]}"
  go ddp && run_on w-ddp2-aa-2 0,1 "${dflt[@]}" --nproc-per-node 2
  # GPU0's references, each beside a second one on GPU1 (the host as loaded as under DDP)
  pair w-1gpu-aa-gpu0 "${dflt[@]}" -- w-1gpu-noaa2-gpu1 "${dflt[@]}" "${no[@]}"
  pair w-1gpu-noaa-gpu0 "${dflt[@]}" "${no[@]}" -- w-1gpu-aa2-gpu1 "${dflt[@]}"
else
  for r in 1 2; do
    go one && run_on w-dali-aa-$r 0 "${dali[@]}"
    go one && run_on w-dali-noaa-$r 0 "${dali[@]}" "${no[@]}"
    go one && run_on w-synth-$r 0 "${syn[@]}"
  done
fi
echo "$SECONDS s: done"
touch $b/PIPE_DONE

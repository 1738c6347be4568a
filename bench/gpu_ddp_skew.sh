#!/usr/bin/env bash
# What DALI costs DDP, and whether DALI's stream hand-off takes it back (BENCHMARKS.md, tenth
# session): with synthetic data DDP kept 96.6% per GPU, with DALI 95.0-95.6%; a DDP step with DALI
# is 0.5-0.75 ms longer against its 1-GPU runs than one on synthetic data. Of that, 0.15-0.4 ms is
# GPU idle between steps and about 0.3 ms the ranks waiting for each other in the all-reduce.
# With the host hand-off (the default) each rank's host waits for its batch's decode before it
# launches the step, so a batch that decodes slowly on one rank holds both. `--dali-handoff
# stream` orders the batch on the training stream instead, and the host runs on ahead.
# Expected: the idle between steps under DDP down to one GPU's (0.1-0.2 ms); scaling up by at most
# 0.5 points, less if the waiting only moves into the all-reduce, as with the late log reads.
# The runs also log each interval's step-to-step spread (`sd`, new): if DALI's 1-GPU steps vary by
# about 1 ms more than synthetic ones, two ranks lose about 0.56 x that to each other per step,
# which would account for the 0.5-0.75 ms (bench/epoch_rates.py's gpu_step_sd_ms).
# Kind nvidia-h200-x2. One visit of back-to-back calls (docs/GPU-MACHINE.md):
#   call 1, carrying .dali/p0, .dali/w, .dali/unpack.sh:
#       bash .dali/unpack.sh stash > /dev/null && bash bench/gpu_ddp_skew.sh a
#   calls 2 and 3, carrying .dali/p1, then .dali/p2:  cp .dali/pN /tmp/dali-stash/
#   call 4, carrying .dali/p3:  cp .dali/p3 /tmp/dali-stash/ && bash bench/gpu_ddp_skew.sh b
#   then:  bash bench/gpu_ddp_skew.sh w   until it prints "pipe done"
# pipe, phase 1 (no DALI needed): the 20,000-image sample set built in the background; synthetic
# data in `default` mode, 1 GPU side by side on both GPUs, then DDP (the ceiling, this call).
# Phase 2 (DALI ready): GPU 1 the log-step GPU test (its idle and data-wait checks have not run
# on a GPU); 1-GPU DALI references side by side, host then stream hand-off; DDP with DALI, host and
# stream hand-off three times each, interleaved; the references again; synthetic DDP again.
# Ran in the eleventh session (BENCHMARKS.md): neither expectation held; the stream hand-off kept
# 95.3% against host's 95.3-95.6%, and it halved one GPU's sd without moving DDP. PIPE_LIMIT
# (default 1,200 s after call 1) stops `pipe` starting runs after that long.

report() { report_runs ddp-skew.tar.gz; }

source bench/visit.sh
visit "${1:-}" bench/gpu_ddp_skew.sh 1200

# ---- pipe: in the background from a; $b/PIPE_DONE at the end ---------------------------------
# dflt (DALI on the sample set, `default` mode) and sdflt (its synthetic twin): bench/device_env.sh
one=(--synthetic-steps 78); two=(--synthetic-steps 39 --nproc-per-node 2)  # 1 GPU; DDP per rank
stream=(--dali-handoff stream)
echo "$SECONDS s: phase 1: sample set; synthetic data, 1 GPU side by side, then DDP"
sample_set 'SampleSpec(train_per_class=2000)'
pair s-1gpu-gpu0 "${sdflt[@]}" "${one[@]}" -- s-1gpu-gpu1 "${sdflt[@]}" "${one[@]}"
go ddp && run_on s-ddp2 0,1 "${sdflt[@]}" "${two[@]}"
ready_or_end
echo "$SECONDS s: DALI ready; $(tail -1 $b/sample.txt); GPU1 the log-step GPU test"
gpu_tests 1 tests/test_gpu.py -k log_step
echo "$SECONDS s: 1-GPU references with DALI, host then stream hand-off"
pair d-1gpu-gpu0 "${dflt[@]}" -- d-1gpu-gpu1 "${dflt[@]}"
pair d-1gpu-stream-gpu0 "${dflt[@]}" "${stream[@]}" -- d-1gpu-stream-gpu1 "${dflt[@]}" "${stream[@]}"
echo "$SECONDS s: DDP with DALI, host and stream hand-off, interleaved"
go ddp && run_on d-ddp2-host 0,1 "${dflt[@]}" --nproc-per-node 2
go ddp && run_on d-ddp2-stream 0,1 "${dflt[@]}" --nproc-per-node 2 "${stream[@]}"
go ddp && run_on d-ddp2-stream-2 0,1 "${dflt[@]}" --nproc-per-node 2 "${stream[@]}"
go ddp && run_on d-ddp2-host-2 0,1 "${dflt[@]}" --nproc-per-node 2
go ddp && run_on d-ddp2-host-3 0,1 "${dflt[@]}" --nproc-per-node 2
go ddp && run_on d-ddp2-stream-3 0,1 "${dflt[@]}" --nproc-per-node 2 "${stream[@]}"
echo "$SECONDS s: the references again"
pair d-1gpu-stream-gpu0-2 "${dflt[@]}" "${stream[@]}" -- d-1gpu-gpu1-2 "${dflt[@]}"
pair d-1gpu-gpu0-2 "${dflt[@]}" -- d-1gpu-stream-gpu1-2 "${dflt[@]}" "${stream[@]}"
go ddp && run_on s-ddp2-2 0,1 "${sdflt[@]}" "${two[@]}"
echo "$SECONDS s: done"
touch $b/PIPE_DONE

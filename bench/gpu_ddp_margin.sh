#!/usr/bin/env bash
# DDP with DALI once more, and what a bf16 all-reduce buys (BENCHMARKS.md, eleventh session).
# The tenth and eleventh sessions' calls kept 95.0-95.6% per GPU with DALI in all nine runs at the
# defaults; the sixth to ninth, 94.0-95.7%. `--dali-handoff stream` changed nothing (95.3%), and
# neither did the late log reads. What is left of DDP's cost on synthetic data (96.4%) is mostly
# inside the step: the all-reduce of the ~94 MB of fp32 gradients after the backward (100 MB
# buckets: one bucket, so exposed, about 0.25 ms at NVLink's rate) and the ranks' step-to-step
# spread. `--ddp-comm-hook bf16` halves the bytes: expected +0.1 ms per step, +0.3%, as in the
# seventh session (+0.3%, within the run-to-run spread). This call measures the default a third
# time in a third call, beside bf16, interleaved. Ran in the eleventh session (BENCHMARKS.md):
# 95.0-95.5% at the defaults, bf16 95.3-95.4%, no difference.
# Kind nvidia-h200-x2. One visit of back-to-back calls (docs/GPU-MACHINE.md):
#   call 1, carrying .dali/p0, .dali/w, .dali/unpack.sh:
#       bash .dali/unpack.sh stash > /dev/null && bash bench/gpu_ddp_margin.sh a
#   calls 2 and 3, carrying .dali/p1, then .dali/p2:  cp .dali/pN /tmp/dali-stash/
#   call 4, carrying .dali/p3:  cp .dali/p3 /tmp/dali-stash/ && bash bench/gpu_ddp_margin.sh b
#   then:  bash bench/gpu_ddp_margin.sh w   until it prints "pipe done"
# pipe, phase 1 (no DALI needed): the sample set built in the background; GPU 1 the log-step GPU
# test (its idle check failed on the H200 at da77c47: the first interval held the kernels'
# first, lazy-loading launches; the test now warms up as the trainer's first step does); synthetic
# data in `default` mode, 1 GPU side by side, then DDP (the ceiling, this call).
# Phase 2 (DALI ready): 1-GPU DALI references side by side; DDP with DALI, fp32 and bf16
# all-reduce interleaved; the references again. PIPE_LIMIT (default 600 s after call 1) stops
# `pipe` starting runs after that long: the session's device time is short.

report() { report_runs ddp-margin.tar.gz; }

source bench/visit.sh
visit "${1:-}" bench/gpu_ddp_margin.sh 600

# ---- pipe: in the background from a; $b/PIPE_DONE at the end ---------------------------------
# dflt (DALI on the sample set, `default` mode) and sdflt (its synthetic twin): bench/device_env.sh
one=(--synthetic-steps 78); two=(--synthetic-steps 39 --nproc-per-node 2)  # 1 GPU; DDP per rank
bf16=(--ddp-comm-hook bf16)
echo "$SECONDS s: phase 1: sample set; GPU 1 the log-step GPU test; synthetic data, 1 GPU, DDP"
sample_set 'SampleSpec(train_per_class=2000)'
gpu_tests 1 tests/test_gpu.py -k log_step
pair s-1gpu-gpu0 "${sdflt[@]}" "${one[@]}" -- s-1gpu-gpu1 "${sdflt[@]}" "${one[@]}"
go ddp && run_on s-ddp2 0,1 "${sdflt[@]}" "${two[@]}"
ready_or_end
echo "$SECONDS s: DALI ready; $(tail -1 $b/sample.txt); 1-GPU references with DALI"
pair d-1gpu-gpu0 "${dflt[@]}" -- d-1gpu-gpu1 "${dflt[@]}"
echo "$SECONDS s: DDP with DALI, fp32 and bf16 all-reduce, interleaved"
go ddp && run_on d-ddp2 0,1 "${dflt[@]}" --nproc-per-node 2
go ddp && run_on d-ddp2-bf16 0,1 "${dflt[@]}" --nproc-per-node 2 "${bf16[@]}"
go ddp && run_on d-ddp2-bf16-2 0,1 "${dflt[@]}" --nproc-per-node 2 "${bf16[@]}"
go ddp && run_on d-ddp2-2 0,1 "${dflt[@]}" --nproc-per-node 2
echo "$SECONDS s: the references again"
pair d-1gpu-gpu0-2 "${dflt[@]}" -- d-1gpu-gpu1-2 "${dflt[@]}"
go ddp && run_on d-ddp2-3 0,1 "${dflt[@]}" --nproc-per-node 2
echo "$SECONDS s: done"
touch $b/PIPE_DONE

#!/usr/bin/env bash
# What the third and fourth sessions changed but could not run on a GPU, in two back-to-back
# calls on a two-GPU machine after the DALI stash. Usage there: bash bench/gpu_next.sh a|b
#   a: GPU1: the GPU tests (the Triton SGD against its own eager step, --batch-size auto with
#      most of the GPU taken), the normalize kernel's tile sweep, the kernel suite. GPU0, in the
#      background: DALI end to end with the fastest compile mode (its first compile autotunes
#      for about 8 minutes).
#   b: waits for GPU0's run; then both GPUs: DataParallel (now without cuDNN autotuning) against
#      DDP at the same global batch, profiled; then DDP compiled + graphed on synthetic data,
#      profiled (the all-reduce's exposed time with no data skew between the ranks).
#   c (a later visit): GPU1: the normalize benchmark with the tile chosen from a's sweep. GPU0: a
#      20,000-image sample set, DALI compiled + graphed on one GPU, profiled; then both GPUs: the
#      same under DDP, profiled; DDP on synthetic data, profiled; DDP with DALI and 100 MB
#      buckets. Then each run's rate with and without epoch starts (bench/epoch_rates.py).
#   d (short): at once, GPU0 DALI and GPU1 synthetic data with the same step on one GPU each (the
#      CLI's DALI cost, in-epoch); then DDP with DALI at the default (auto: 100 MB) and 25 MB.
#   e: GPU1 the GPU tests; GPU0 the whole pytest-benchmark suite (bench/gpu_suite.sh). The fifth
#      session ran the same two one after the other on a one-GPU machine, by hand.
#   f (not yet run): DDP with DALI at 100 and 25 MB buckets, each twice and interleaved, between
#      two 1-GPU runs (the bucket default rests on one same-call comparison).
#   i, j (fifth session, a two-GPU machine): i, right after the first stash call, needs no DALI:
#      in the background, GPU1 runs the Triton max-pool's tests, its kernel benchmark (tile
#      sweep, against inductor and eager) and the step with and without it (`default` mode),
#      while the 20,000-image set is built. j, after the last stash call: GPU0 DALI end to end
#      with --compile-mode auto (coordinate-descent tuning, about 5 minutes) and the max-pool;
#      once GPU0's tuning is cached and GPU1 is free, the same step on synthetic data on GPU1
#      (the DALI cost, side by side). j waits J_WAIT seconds (default 420), then reports.
#   k (not yet run; the next visit, after the stash): the defaults (coordinate-descent tuning, the
#      Triton max-pool at its new tile) on GPU0 with DALI on the 20,000-image set and on GPU1 with
#      synthetic data, at the same time, twice: first with inductor's caches cold, then warm.
#      Gives the DALI cost side by side, end to end against 7,000 img/s, and the cold/warm
#      start-up ratio of one unchanged command (issue 4 asks for 3x).
#   k (superseded by m, which adds the loader settings below; not run)
#   m0, m1, m2 (sixth session, a two-GPU machine): where DALI's remaining cost goes. The fifth
#      session's DALI run spent 1.6 ms per step with its GPU outside the step (synthetic data:
#      0.4): batches arriving late. Deeper prefetch (--dali-prefetch) gives DALI's decode more
#      slack; the stream hand-off (--dali-handoff stream) launches each step without waiting
#      for its batch on the host. m0, with the first stash call (no DALI): builds the 20,000-
#      image set; GPU0 the GPU tests; GPU1 the defaults on synthetic data, inductor's caches
#      cold. m1, after the last stash call: GPU0 the defaults with DALI cold, then warm (the
#      start-up ratio of one unchanged command), then prefetch 4, stream + prefetch 4, and the
#      default again, interleaved; GPU1 the synthetic run warm, then bench/dali_e2e.py's
#      hand-off set in one process. m2 (a fresh machine: the stash again, and the 20,000-image
#      set built during it): GPU1 the defaults on synthetic data cold, then warm (torch 2.11's
#      warm starts re-ran coordinate-descent tuning; fasttrain.torch_fixes), while GPU0 runs the
#      DALI GPU tests, a trace of prefetch 2 against 4, and 1-GPU DALI runs; then per-GPU
#      scaling with DALI (`default` compile mode, whose DDP compile fits in a call) with the
#      settings in $WIN against the defaults.
#   n1, q, qw (the seventh session, a two-GPU machine): n1 with the first stash call (no DALI):
#      builds the 20,000-image set; GPU0 the GPU tests; GPU1 the defaults on synthetic data,
#      inductor's caches cold. q after the last stash call starts qpipe in the background and
#      reports as it goes; qw (the next calls, back to back) waits for it and reports; the last
#      qw returns everything. qpipe: GPU0 the defaults with DALI, cold (the DALI command's
#      start-up with the warm-start fix), while GPU1 runs the DALI GPU tests and traces of
#      synthetic data, prefetch 2 and prefetch 4 (bench/dali_e2e.py --only-trace: DALI's own GPU
#      time per step); then DALI against synthetic data warm, side by side, and again with the
#      GPUs swapped, twice (DALI's cost with equal load on both GPUs); then per-GPU scaling with
#      DALI (`default` compile mode): DDP between 1-GPU runs, plain, with --ddp-comm-hook bf16
#      (half the all-reduce's bytes) and with NCCL_MAX_NCHANNELS=8 (fewer SMs taken from the
#      backward), twice. QPIPE_LIMIT (default 1140 s) stops it starting runs after that long.
#   r1, r2 (superseded: the eighth session measured this with bench/gpu_priority.sh at 541b03e,
#      since removed with its trainer flag: no difference, BENCHMARKS.md): whether the step on a high-priority
#      stream takes back DALI's cost (the seventh session's trace: the step's kernels run 3.3%
#      slower beside DALI's). r1 with the first stash call: builds the 20,000-image set in the
#      background. r2 after the last: bench/dali_e2e.py --set priority on both GPUs at once (two
#      replicates; each compares, in one process, the default stream with a high-priority one,
#      for DALI and for synthetic data). If it helps, the trainer gets the option, and the CLI's
#      side-by-side pairs (as in q) measure it end to end.
#   g, h (superseded: the fifth session compared default, coordinate-descent tuning and
#      max-autotune in one process, and read the autotune log for the conv and matmul choices):
#      what max-autotune's conv and matmul choices each buy (issue 4), the step
#      alone at batch 256, compiled + graphed, in the background on both GPUs (each autotune
#      takes minutes): GPU0 the `default` mode with matmul autotuning only (1x1 convs as
#      matmuls, so they are tuned too), GPU1 conv autotuning only (matmuls left to aten); then
#      `default` with no options on each GPU for the side-by-side. h waits and prints.
set -uo pipefail
part=${1:?a to qw}
out=${OUT:-gpu-out}; mkdir -p "$out"
b=/tmp/bench; mkdir -p $b
big=/tmp/fasttrain-cache/sample-v1-c10-t2000-v50-s300-480-q90-seed0  # SampleSpec(train_per_class=2000)
# build_big: that 20,000-image set (once per machine), its log in $b/sample.txt, then $b/SAMPLE
build_big() {
  python -c 'from fasttrain.data.sample import SampleSpec, build_sample as b; b("/tmp/fasttrain-cache", SampleSpec(train_per_class=2000))' > $b/sample.txt 2>&1
  touch $b/SAMPLE
}
export -f build_big
# finish: every run's summary line, then $b and each run's summary, log and breakdown to $OUT
finish() {
  cut -c1-400 $b/summaries.jsonl 2>/dev/null
  tar -czf "$out/next-$part.tar.gz" --exclude='*.pt.trace.json' -C /tmp bench
  for r in /tmp/runs/*/; do
    n=$(basename $r); mkdir -p $out/runs/$n
    cp $r/summary.json $r/log-rank0.txt $r/profile/breakdown-rank*.json $out/runs/$n/ 2>/dev/null
  done
}
if [ "$part" = i ]; then  # before DALI has arrived: no device_env.sh
  python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip-install.log 2>&1 \
    || { cat /tmp/pip-install.log; exit 1; }
  export PYTHONUNBUFFERED=1 FASTTRAIN_CACHE=/tmp/fasttrain-cache b
  setsid nohup bash -c '
    build_big &
    export CUDA_VISIBLE_DEVICES=1
    python -m pytest -q -rA -p no:cacheprovider tests/test_kernels.py tests/test_gpu.py -k maxpool > $b/tests-maxpool.txt 2>&1
    python -m pytest -q -p no:cacheprovider bench/test_kernels.py -k maxpool --benchmark-json $b/maxpool.json > $b/maxpool.txt 2>&1
    python bench/report.py $b/maxpool.json > $b/maxpool.md 2>&1
    python bench/step_variants.py --batch 256 --kinds compiled+graph --mode default --kernels none maxpool > $b/variants-maxpool.txt 2>&1
    wait; touch $b/DONE1' > /dev/null 2>&1 < /dev/null &
  sleep 2; exit 0
fi
if [ "$part" = m0 ]; then  # with the first stash call: DALI is not there yet
  NO_DALI=1 source bench/device_env.sh
  same=(--config configs/sample.yaml --compile --cuda-graphs --epochs 8 --eval-every 0)
  rm -rf /tmp/torchinductor_$(whoami)  # cold: a fresh machine has none, this makes sure
  setsid nohup bash -c '
    build_big &
    (CUDA_VISIBLE_DEVICES=0 python -m pytest -q -rA -p no:cacheprovider tests/test_gpu.py tests/test_kernels.py > $b/tests.txt 2>&1; touch $b/TESTS) &
    run_on m-synth-cold 1 --loader synthetic --synthetic-steps 78 --num-classes 10 "$@"
    touch $b/SYNTH; wait' _ "${same[@]}" > /dev/null 2>&1 < /dev/null &
  sleep 2; exit 0
fi
if [ "$part" = n1 ]; then  # with the first stash call: DALI is not there yet
  NO_DALI=1 source bench/device_env.sh
  rm -rf /tmp/torchinductor_$(whoami)
  setsid nohup bash -c '
    build_big &
    (CUDA_VISIBLE_DEVICES=0 python -m pytest -q -rA -p no:cacheprovider tests/test_gpu.py tests/test_kernels.py > $b/tests.txt 2>&1; touch $b/TESTS) &
    run_on n-synth-cold 1 --loader synthetic --synthetic-steps 78 --num-classes 10 "$@"
    touch $b/SYNTH; wait' _ --config configs/sample.yaml --compile --cuda-graphs --epochs 8 \
    --eval-every 0 > /dev/null 2>&1 < /dev/null &
  sleep 2; exit 0
fi
if [ "$part" = r1 ]; then  # with the first stash call: DALI is not there yet
  NO_DALI=1 source bench/device_env.sh
  setsid nohup bash -c 'build_big' > /dev/null 2>&1 < /dev/null &
  sleep 2; exit 0
fi
if [ "$part" = r2 ]; then  # after the last stash call
  source bench/device_env.sh
  while [ ! -e $b/SAMPLE ] && [ $SECONDS -lt 150 ]; do sleep 2; done
  for g in 0 1; do
    CUDA_VISIBLE_DEVICES=$g setsid nohup bash -c "python bench/dali_e2e.py $big --set priority \
      --maxpool --no-trace --jsonl $b/priority-gpu$g.jsonl > $b/priority-gpu$g.txt 2>&1; \
      touch $b/PRIO$g" > /dev/null 2>&1 < /dev/null &
  done
  while { [ ! -e $b/PRIO0 ] || [ ! -e $b/PRIO1 ]; } && [ $SECONDS -lt 540 ]; do sleep 3; done
  grep -h "^|" $b/priority-gpu*.txt
  finish; exit 0
fi
if [ "$part" = q ]; then  # after the last stash call: DALI is all there
  source bench/device_env.sh
  setsid nohup bash bench/gpu_next.sh qpipe > $b/qpipe.txt 2>&1 < /dev/null &
  part=qw
fi
if [ "$part" = qw ]; then  # wait for qpipe (up to 540 s of this call), report, return what is there
  while [ ! -e $b/QDONE ] && [ $SECONDS -lt 540 ]; do sleep 5; done
  tail -3 $b/tests.txt $b/tests-dali.txt 2>/dev/null; cat $b/qpipe.txt
  grep -h -A12 "^== " $b/dali_trace.txt 2>/dev/null | cut -c1-160
  grep -h "first step done\|Traceback\|rror\|capturing the training step failed" $b/runs-*.txt | cut -c1-220 | head -40
  python bench/epoch_rates.py /tmp/runs/*/ > $b/epoch_rates.jsonl 2>&1; cut -c1-300 $b/epoch_rates.jsonl
  [ -e $b/QDONE ] && echo "qpipe done" || echo "qpipe still running: call qw again"
  finish; exit 0
fi
if [ "$part" = qpipe ]; then  # in the background, from q; $b/QDONE at the end
  source bench/device_env.sh
  limit=${QPIPE_LIMIT:-1140}
  auto=(--config configs/sample.yaml --compile --cuda-graphs --epochs 8 --eval-every 0)
  dali=(--data $big "${auto[@]}")
  syn=(--loader synthetic --synthetic-steps 78 --num-classes 10 "${auto[@]}")
  dflt=(--config configs/sample.yaml --data $big --compile --compile-mode default --cuda-graphs --epochs 8 --eval-every 0)
  while [ ! -e $b/SAMPLE ] && [ $SECONDS -lt 300 ]; do sleep 2; done
  echo "$SECONDS s: sample set there; GPU0 DALI cold"
  run_on q-dali-cold 0 "${dali[@]}" &
  while { [ ! -e $b/SYNTH ] || [ ! -e $b/TESTS ]; } && [ $SECONDS -lt 420 ]; do sleep 2; done
  echo "$SECONDS s: GPU1 the DALI GPU tests, then the traces"
  CUDA_VISIBLE_DEVICES=1 python -m pytest -q -rA -p no:cacheprovider tests/test_dali.py -m gpu > $b/tests-dali.txt 2>&1
  CUDA_VISIBLE_DEVICES=1 TRACE_DIR=/tmp python bench/dali_e2e.py $big --maxpool --only-trace > $b/dali_trace.txt 2>&1
  wait
  for r in 1 2; do  # DALI against synthetic data, both warm, side by side, then the GPUs swapped
    echo "$SECONDS s: round $r"
    run_on q-dali-$r-gpu0 0 "${dali[@]}" & run_on q-synth-$r-gpu1 1 "${syn[@]}"; wait
    run_on q-dali-$r-gpu1 1 "${dali[@]}" & run_on q-synth-$r-gpu0 0 "${syn[@]}"; wait
  done
  for r in 1 2; do  # per-GPU scaling, `default` mode
    echo "$SECONDS s: scaling round $r"
    [ $SECONDS -lt $limit ] && run_on q3-1gpu-$r $((r - 1)) "${dflt[@]}"
    [ $SECONDS -lt $limit ] && run_on q3-ddp2-$r 0,1 "${dflt[@]}" --nproc-per-node 2
    [ $SECONDS -lt $limit ] && run_on q3-ddp2-bf16-$r 0,1 "${dflt[@]}" --nproc-per-node 2 --ddp-comm-hook bf16
    [ $SECONDS -lt $limit ] && NCCL_MAX_NCHANNELS=8 run_on q3-ddp2-nch8-$r 0,1 "${dflt[@]}" --nproc-per-node 2
  done
  [ $SECONDS -lt $limit ] && run_on q3-1gpu-3 0 "${dflt[@]}"
  echo "$SECONDS s: done"
  touch $b/QDONE
  exit 0
fi
source bench/device_env.sh
synth=(--loader synthetic --synthetic-steps 40 --num-classes 10 --eval-every 0 --config configs/sample.yaml)
if [ "$part" = a ]; then
  setsid nohup bash -c '
    run_on dali-autotune 0 --compile --compile-mode max-autotune-no-cudagraphs --cuda-graphs \
      --epochs 6 --eval-every 0
    touch $b/DONE0' > /dev/null 2>&1 < /dev/null &
  export CUDA_VISIBLE_DEVICES=1
  python -m pytest -q -rA -p no:cacheprovider tests/test_gpu.py tests/test_kernels.py > $b/tests.txt 2>&1
  tail -3 $b/tests.txt
  python bench/normalize_tiles.py > $b/normalize_tiles.txt 2>&1; tail -4 $b/normalize_tiles.txt
  python -m pytest -q -p no:cacheprovider bench/test_kernels.py --benchmark-json $b/kernels.json > $b/kernels.txt 2>&1
  python bench/report.py $b/kernels.json > $b/kernels.md 2>&1; grep -i normalize $b/kernels.md
  unset CUDA_VISIBLE_DEVICES
  while [ ! -e $b/DONE0 ] && [ $SECONDS -lt 560 ]; do sleep 5; done
elif [ "$part" = c ]; then
  dali=(--data $big --compile --compile-mode default --cuda-graphs --epochs 5 --eval-every 0)
  (CUDA_VISIBLE_DEVICES=1 python -m pytest -q -p no:cacheprovider bench/test_kernels.py -k normalize \
     --benchmark-json $b/normalize.json > $b/normalize.txt 2>&1
   python bench/report.py $b/normalize.json > $b/normalize.md 2>&1) &
  build_big
  echo "sample set built after $SECONDS s" >> $b/sample.txt
  run_on dali-1gpu 0 "${dali[@]}" --profile --profile-wait 100
  wait; cat $b/normalize.md
  run_on dali-ddp2 0,1 "${dali[@]}" --nproc-per-node 2 --profile --profile-wait 100
  run_on synth-ddp2 0,1 "${synth[@]}" --compile-mode default --nproc-per-node 2 --compile \
    --cuda-graphs --epochs 4 --profile --profile-wait 100
  [ $SECONDS -lt 430 ] && run_on dali-ddp2-bucket100 0,1 "${dali[@]}" --nproc-per-node 2 --bucket-cap-mb 100
  python bench/epoch_rates.py /tmp/runs/*/ | tee $b/epoch_rates.jsonl
  grep -h -A7 "step time breakdown" $b/runs-*.txt
elif [ "$part" = d ]; then
  same=(--config configs/sample.yaml --compile --compile-mode default --cuda-graphs --epochs 5 --eval-every 0)
  build_big
  run_on d-dali-1gpu 0 --data $big "${same[@]}" &
  run_on d-synth-1gpu 1 --loader synthetic --synthetic-steps 78 --num-classes 10 "${same[@]}"
  wait
  run_on d-dali-ddp2-auto 0,1 --data $big "${same[@]}" --nproc-per-node 2
  [ $SECONDS -lt 200 ] && run_on d-dali-ddp2-b25 0,1 --data $big "${same[@]}" --nproc-per-node 2 --bucket-cap-mb 25
  python bench/epoch_rates.py /tmp/runs/d-*/ | tee $b/epoch_rates.jsonl
elif [ "$part" = e ]; then
  CUDA_VISIBLE_DEVICES=1 python -m pytest -q -rA -p no:cacheprovider tests/test_gpu.py tests/test_kernels.py > $b/tests.txt 2>&1 &
  CUDA_VISIBLE_DEVICES=0 OUT=$b/suite bash bench/gpu_suite.sh > $b/suite.txt 2>&1
  wait; tail -3 $b/tests.txt; tail -30 $b/suite/bench.md
elif [ "$part" = f ]; then
  same=(--config configs/sample.yaml --data $big --compile --compile-mode default --cuda-graphs --epochs 5 --eval-every 0)
  build_big
  run_on f-dali-1gpu 0 "${same[@]}"
  for round in 1 2; do
    [ $SECONDS -lt 420 ] && run_on f-ddp2-b100-$round 0,1 "${same[@]}" --nproc-per-node 2 --bucket-cap-mb 100
    [ $SECONDS -lt 480 ] && run_on f-ddp2-b25-$round 0,1 "${same[@]}" --nproc-per-node 2 --bucket-cap-mb 25
  done
  [ $SECONDS -lt 540 ] && run_on f-dali-1gpu-again 0 "${same[@]}"
  python bench/epoch_rates.py /tmp/runs/f-*/ | tee $b/epoch_rates.jsonl
elif [ "$part" = g ]; then
  sv="python bench/step_variants.py --batch 256 --kinds compiled+graph --mode default --jsonl $b/variants.jsonl"
  setsid nohup bash -c "CUDA_VISIBLE_DEVICES=0 $sv --options none conv_1x1_as_mm,max_autotune_gemm > $b/variants-gemm.txt 2>&1; touch $b/DONE0" > /dev/null 2>&1 < /dev/null &
  setsid nohup bash -c "CUDA_VISIBLE_DEVICES=1 $sv --options none max_autotune,max_autotune_gemm_backends=ATEN > $b/variants-conv.txt 2>&1; touch $b/DONE1" > /dev/null 2>&1 < /dev/null &
  while { [ ! -e $b/DONE0 ] || [ ! -e $b/DONE1 ]; } && [ $SECONDS -lt 560 ]; do sleep 5; done
  cat $b/variants-*.txt
elif [ "$part" = j ]; then
  same=(--config configs/sample.yaml --compile --cuda-graphs --epochs 8 --eval-every 0 --triton-kernels maxpool)
  while [ ! -e $b/SAMPLE ] && [ $SECONDS -lt 120 ]; do sleep 2; done
  setsid nohup bash -c 'run_on j-dali 0 "$@"; touch $b/DONE0' _ --data $big "${same[@]}" > /dev/null 2>&1 < /dev/null &
  started=
  while [ $SECONDS -lt "${J_WAIT:-420}" ]; do
    if [ -z "$started" ] && [ -e $b/DONE1 ] && grep -q "captured" $b/runs-j-dali.txt 2>/dev/null; then
      setsid nohup bash -c 'run_on j-synth 1 "$@"; touch $b/DONE2' _ --loader synthetic \
        --synthetic-steps 78 --num-classes 10 "${same[@]}" > /dev/null 2>&1 < /dev/null &
      started=1
    fi
    [ -e $b/DONE0 ] && [ -e $b/DONE2 ] && break
    sleep 3
  done
  tail -3 $b/tests-maxpool.txt; cat $b/maxpool.md; grep "^|" $b/variants-maxpool.txt
  grep -h "first step\|captured\|img/s" $b/runs-j-*.txt | cut -c1-200 | tail -12
  python bench/epoch_rates.py /tmp/runs/j-*/ | tee $b/epoch_rates.jsonl
elif [ "$part" = k ]; then
  same=(--config configs/sample.yaml --compile --cuda-graphs --epochs 8 --eval-every 0)
  build_big
  rm -rf /tmp/torchinductor_$(whoami)  # cold: a fresh machine has none, this makes sure
  for start in cold warm; do
    run_on k-dali-$start 0 --data $big "${same[@]}" &
    run_on k-synth-$start 1 --loader synthetic --synthetic-steps 78 --num-classes 10 "${same[@]}"
    wait
  done
  grep -h "first step done\|done:" $b/runs-k-*.txt | cut -c1-200
  python bench/epoch_rates.py /tmp/runs/k-*/ | tee $b/epoch_rates.jsonl
elif [ "$part" = m1 ]; then
  same=(--config configs/sample.yaml --compile --cuda-graphs --epochs 8 --eval-every 0)
  while [ ! -e $b/SAMPLE ] && [ $SECONDS -lt 120 ]; do sleep 2; done
  setsid nohup bash -c '
    run_on m-dali-cold 0 "$@"; run_on m-dali-warm 0 "$@"
    run_on m-dali-p4 0 "$@" --dali-prefetch 4
    run_on m-dali-stream-p4 0 "$@" --dali-handoff stream --dali-prefetch 4
    [ $SECONDS -lt 440 ] && run_on m-dali-again 0 "$@"
    [ $SECONDS -lt 500 ] && run_on m-dali-p4-again 0 "$@" --dali-prefetch 4
    touch $b/DONE0' _ --data $big "${same[@]}" > /dev/null 2>&1 < /dev/null &
  while [ ! -e $b/SYNTH ] && [ $SECONDS -lt 300 ]; do sleep 2; done
  run_on m-synth-warm 1 --loader synthetic --synthetic-steps 78 --num-classes 10 "${same[@]}"
  CUDA_VISIBLE_DEVICES=1 timeout $((570 - SECONDS)) python bench/dali_e2e.py $big --maxpool \
    --no-trace --jsonl $b/dali_e2e.jsonl > $b/dali_e2e.txt 2>&1
  while [ ! -e $b/DONE0 ] && [ $SECONDS -lt 575 ]; do sleep 3; done
  tail -3 $b/tests.txt; grep "^|" $b/dali_e2e.txt
  grep -h "first step done\|DALI loader" $b/runs-m-*.txt | cut -c1-200
  python bench/epoch_rates.py /tmp/runs/m-*/ | tee $b/epoch_rates.jsonl
elif [ "$part" = m2 ]; then
  same=(--config configs/sample.yaml --data $big --compile --compile-mode default --cuda-graphs --epochs 8 --eval-every 0)
  auto=(--config configs/sample.yaml --compile --cuda-graphs --epochs 8 --eval-every 0)
  read -ra win <<< "${WIN:?the loader flags m1 found best}"
  while [ ! -e $b/SAMPLE ] && [ $SECONDS -lt 120 ]; do sleep 2; done
  # GPU1: the defaults (coordinate-descent tuning) cold, then warm, with the warm-start fix
  rm -rf /tmp/torchinductor_$(whoami)
  setsid nohup bash -c 'run_on m2-synth-cold 1 "$@"; run_on m2-synth-warm 1 "$@"; touch $b/DONE1' _ \
    --loader synthetic --synthetic-steps 78 --num-classes 10 "${auto[@]}" > /dev/null 2>&1 < /dev/null &
  CUDA_VISIBLE_DEVICES=0 python -m pytest -q -rA -p no:cacheprovider tests/test_dali.py -m gpu > $b/tests-dali.txt 2>&1
  CUDA_VISIBLE_DEVICES=0 TRACE_DIR=/tmp python bench/dali_e2e.py $big --maxpool --only-trace > $b/dali_trace.txt 2>&1
  run_on m2-1gpu-win 0 "${same[@]}" "${win[@]}"
  run_on m2-1gpu-default 0 "${same[@]}"
  while [ ! -e $b/DONE1 ] && [ $SECONDS -lt 400 ]; do sleep 3; done
  tail -3 $b/tests-dali.txt; tail -50 $b/dali_trace.txt | cut -c1-160
  run_on m2-ddp2-win 0,1 "${same[@]}" "${win[@]}" --nproc-per-node 2
  [ $SECONDS -lt 480 ] && run_on m2-ddp2-default 0,1 "${same[@]}" --nproc-per-node 2
  [ $SECONDS -lt 530 ] && run_on m2-ddp2-win-again 0,1 "${same[@]}" "${win[@]}" --nproc-per-node 2
  grep -h "first step done\|DALI loader" $b/runs-m2-*.txt | cut -c1-200
  python bench/epoch_rates.py /tmp/runs/m2-*/ | tee $b/epoch_rates-m2.jsonl
elif [ "$part" = m3 ]; then  # the stash's first call built the 20,000-image set (setsid)
  same=(--config configs/sample.yaml --data $big --compile --compile-mode default --cuda-graphs --epochs 8 --eval-every 0)
  while [ ! -e $b/SAMPLE ] && [ $SECONDS -lt 150 ]; do sleep 2; done
  CUDA_VISIBLE_DEVICES=0 python bench/dali_order_check.py > $b/order.txt 2>&1
  run_on m3-1gpu-p4 0 "${same[@]}" --dali-prefetch 4
  run_on m3-ddp2-p4 0,1 "${same[@]}" --dali-prefetch 4 --nproc-per-node 2
  run_on m3-ddp2-p2 0,1 "${same[@]}" --nproc-per-node 2
  [ $SECONDS -lt 440 ] && run_on m3-1gpu-p2 0 "${same[@]}"
  [ $SECONDS -lt 500 ] && run_on m3-ddp2-p4-again 0,1 "${same[@]}" --dali-prefetch 4 --nproc-per-node 2
  head -20 $b/order.txt | cut -c1-160; tail -3 $b/order.txt
  grep -h "first step done" $b/runs-m3-*.txt | cut -c1-200
  python bench/epoch_rates.py /tmp/runs/m3-*/ | tee $b/epoch_rates-m3.jsonl
elif [ "$part" = h ]; then
  while { [ ! -e $b/DONE0 ] || [ ! -e $b/DONE1 ]; } && [ $SECONDS -lt 560 ]; do sleep 5; done
  cat $b/variants-*.txt
else
  while [ ! -e $b/DONE0 ] && [ $SECONDS -lt 300 ]; do sleep 5; done
  timeout 200 bash -c 'run_on dp-eager 0,1 "$@"' _ "${synth[@]}" --strategy dp --epochs 2 --profile --profile-wait 50
  run_on ddp-eager 0,1 "${synth[@]}" --nproc-per-node 2 --epochs 3 --profile --profile-wait 50
  run_on ddp-synth-graph 0,1 "${synth[@]}" --compile-mode default --nproc-per-node 2 --compile \
    --cuda-graphs --epochs 4 --profile --profile-wait 50
fi
finish

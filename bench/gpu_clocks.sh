#!/usr/bin/env bash
# Is DALI's end-to-end cost the step's kernels at a lower SM clock? One GPU (kind nvidia-h200),
# one visit of back-to-back calls (docs/GPU-MACHINE.md):
#   call 1, carrying .dali/p0, .dali/w, .dali/unpack.sh:
#       bash .dali/unpack.sh stash > /dev/null && bash bench/gpu_clocks.sh a
#   calls 2 and 3, carrying .dali/p1, then .dali/p2:  cp .dali/pN /tmp/dali-stash/
#   call 4, carrying .dali/p3:  cp .dali/p3 /tmp/dali-stash/ && bash bench/gpu_clocks.sh b
# a: builds the built-in sample set (10,000 images), in the background, waiting up to 90 s. b: nvidia-smi logs SM
# clock, power, temperature and the clock-limit reasons every 100 ms while bench/dali_e2e.py
# --set clocks times synthetic data and DALI twice each (then DALI alone, and DALI pulled beside
# the step on synthetic data); bench/clocks.py lines the two up. Why: the seventh session's
# trace has the step's own kernels 3.3% slower beside DALI while batches arrive in time, and the
# step on a high-priority stream (eighth session) did not change that, so SM scheduling is not
# the cause; a shared power limit would be.
set -uo pipefail
part=${1:?a or b}
out=${OUT:-gpu-out}; mkdir -p "$out"
b=/tmp/bench; mkdir -p $b
if [ "$part" = a ]; then
  NO_DALI=1 source bench/device_env.sh
  nvidia-smi --query-gpu=index,name,power.limit,clocks.max.sm --format=csv,noheader
  sample_set 'SampleSpec()' 90; exit 0
fi
source bench/device_env.sh
while [ ! -e $b/SAMPLE ] && [ $SECONDS -lt 120 ]; do sleep 2; done
reasons=$(nvidia-smi --help-query-gpu | grep -o 'clocks_event_reasons.active\|clocks_throttle_reasons.active' | head -1)
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,$reasons --format=csv,noheader \
  -lms 100 > $b/smi.csv 2> $b/smi.err &
smi=$!
timeout 420 python bench/dali_e2e.py --set clocks --epochs 6 --no-trace --maxpool \
  --marks $b/marks.jsonl > $b/clocks-e2e.txt 2>&1
kill $smi
cat $b/clocks-e2e.txt; head -2 $b/smi.csv; cat $b/smi.err
python bench/clocks.py $b/smi.csv $b/marks.jsonl | tee $b/clocks.md
tar -czf "$out/clocks.tar.gz" -C /tmp bench

#!/usr/bin/env bash
# What DALI's GPU work beside the step is made of, and whether less of it (the train resize
# without its antialiasing filter, as in NVIDIA's ResNet-50 reference pipeline) takes back part
# of DALI's cost. One GPU (kind nvidia-h200), one visit of back-to-back calls
# (docs/GPU-MACHINE.md):
#   call 1, carrying .dali/p0, .dali/w, .dali/unpack.sh:
#       bash .dali/unpack.sh stash > /dev/null && bash bench/gpu_dali_work.sh a
#   calls 2 and 3, carrying .dali/p1, then .dali/p2:  cp .dali/pN /tmp/dali-stash/
#   call 4, carrying .dali/p3:  cp .dali/p3 /tmp/dali-stash/ && bash bench/gpu_dali_work.sh b
# a: builds the 20,000-image sample set (the earlier sessions' traces used it), waiting up to
# 150 s. b: bench/dali_e2e.py --set resize: synthetic data, DALI with the antialiased resize and
# without, twice each, in one process; then traces of the three, each with the GPU work off the
# training stream listed by kernel name (the RGBA -> RGB conversion, the copies, the resize,
# the normalize). Not yet run.
# Why: the eighth session ruled out stream priority and the SM clock as the cause of DALI's 3%;
# what is left is DALI's own GPU work beside the step, so the lever is doing less of it.
set -uo pipefail
part=${1:?a or b}
out=${OUT:-gpu-out}; mkdir -p "$out"
b=/tmp/bench; mkdir -p $b
big=/tmp/fasttrain-cache/sample-v1-c10-t2000-v50-s300-480-q90-seed0  # SampleSpec(train_per_class=2000)
if [ "$part" = a ]; then
  NO_DALI=1 source bench/device_env.sh
  nvidia-smi --query-gpu=index,name,power.limit --format=csv,noheader
  sample_set 'SampleSpec(train_per_class=2000)' 150; exit 0
fi
source bench/device_env.sh
while [ ! -e $b/SAMPLE ] && [ $SECONDS -lt 150 ]; do sleep 2; done
TRACE_DIR=$b timeout 540 python bench/dali_e2e.py $big --set resize --maxpool --epochs 6 \
  --jsonl $b/resize.jsonl > $b/resize.txt 2>&1
grep -v "^  tid" $b/resize.txt | cut -c1-170
tar -czf "$out/dali-work.tar.gz" --exclude='*.json' -C /tmp bench

# Sourced by the bench/gpu_*.sh scripts on the GPU machine, from the repository root: DALI from the
# stash (../shared/device/dali-bundle.sh), and fasttrain installed editable without dependencies,
# so that kernels/ imports as fasttrain.kernels (pyproject's package-dir), as it does here.
# NO_DALI=1: before the last stash call, when the pieces are not all there yet
[ -n "${NO_DALI:-}" ] || bash /tmp/dali-stash/unpack.sh install > /dev/null || exit 1
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip-install.log 2>&1 \
  || { cat /tmp/pip-install.log; exit 1; }
export PYTHONPATH=/tmp/dali-site PYTHONUNBUFFERED=1 FASTTRAIN_CACHE=/tmp/fasttrain-cache

# summary NAME: /tmp/runs/NAME/summary.json as one JSON line in $b/summaries.jsonl (set b first)
summary() {
  python -c "import json,sys; print(json.dumps({'run': sys.argv[1], **json.load(open(sys.argv[2]))}))" \
    "$1" "/tmp/runs/$1/summary.json" >> $b/summaries.jsonl 2>/dev/null \
    || echo "{\"run\": \"$1\", \"failed\": true}" >> $b/summaries.jsonl
}

# run_on NAME GPUS FLAGS...: python -m fasttrain on those GPUs into /tmp/runs/NAME, its output in
# $b/runs-NAME.txt, then its summary line
run_on() {
  local name=$1 gpus=$2; shift 2
  echo "=== $name (GPUs $gpus): python -m fasttrain $*" >> $b/runs-$name.txt
  CUDA_VISIBLE_DEVICES=$gpus python -m fasttrain --output-dir /tmp/runs/$name "$@" >> $b/runs-$name.txt 2>&1
  summary "$name"
}
export -f summary run_on; export b

# sample_set 'SampleSpec(...)' [SECONDS]: build that sample set in the background ($b/SAMPLE when
# done, its log in $b/sample.txt). With SECONDS, wait up to that long for it and print its last
# line: a call that started it must not return while it imports fasttrain, since the next call
# copies the working tree onto the machine again
sample_set() {
  setsid nohup bash -c "python -c 'from fasttrain.data.sample import SampleSpec, build_sample as s
s(\"/tmp/fasttrain-cache\", $1)' > $b/sample.txt 2>&1; touch $b/SAMPLE" > /dev/null 2>&1 < /dev/null &
  [ -n "${2:-}" ] || return 0
  while [ ! -e $b/SAMPLE ] && [ $SECONDS -lt "$2" ]; do sleep 2; done
  tail -1 $b/sample.txt
}

# The sample-set runs of BENCHMARKS.md's tables since the fourth session, one definition for every
# script that compares them: SampleSpec(train_per_class=2000) (20,000 JPEGs, 78 steps per epoch
# on one GPU, 39 per rank on two); the CLI's defaults (`auto`) on synthetic data (`syn`) and on the
# set (`dali`), and `default` compile mode on the set (`dflt`, the DDP scaling runs) and on
# synthetic data (`sdflt`)
set20k=/tmp/fasttrain-cache/sample-v1-c10-t2000-v50-s300-480-q90-seed0
auto=(--config configs/sample.yaml --compile --cuda-graphs --epochs 8 --eval-every 0)
syn=(--loader synthetic --synthetic-steps 78 --num-classes 10 "${auto[@]}")
dali=(--data $set20k "${auto[@]}")
dflt=(--config configs/sample.yaml --data $set20k --compile --compile-mode default --cuda-graphs
      --epochs 8 --eval-every 0)
# dflt's twin on synthetic data (the caller adds --synthetic-steps: 78 on one GPU, 39 per rank)
sdflt=(--loader synthetic --num-classes 10 --config configs/sample.yaml --compile --compile-mode
       default --cuda-graphs --epochs 8 --eval-every 0)

# cold_start NAME, in a visit's pipe (bench/visit.sh): its opening on set20k: inductor's
# caches cleared (cold, as on a fresh machine; this makes sure), the set built in the background,
# and GPU 0 the defaults on synthetic data as run NAME ($b/SYNTH when done); returns once DALI and
# the set are ready, or else ends the pipe
cold_start() {
  rm -rf /tmp/torchinductor_$(whoami)
  sample_set 'SampleSpec(train_per_class=2000)'
  (run_on "$1" 0 "${syn[@]}"; touch $b/SYNTH) &
  ready_or_end  # bench/visit.sh
}

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

# The calls of one visit to the GPU machine, for a bench/gpu_*.sh script whose work runs in one
# background `pipe` (docs/GPU-MACHINE.md). The script defines report(), sources this file (which
# sets the options, $out, the folder that comes back, and $b, the visit's working folder), then
#   visit "${1:-}" bench/gpu_NAME.sh LIMIT   (LIMIT: the pipe's default limit, in seconds)
# a: starts `bench/gpu_NAME.sh pipe` in the background and returns once the pipe has touched
#    $b/STARTED (its first imports done before the next call copies the working tree again).
# b: unpacks DALI from the stash, marks it ready ($b/DALI_READY), then does what w does.
# w: waits up to 540 s for $b/PIPE_DONE, reports, and says whether the pipe is done.
# pipe: installs fasttrain (bench/device_env.sh), sets the pipe's limit (PIPE_LIMIT, or the
#    script's default, the third argument) for `go` and `wait_for`, and returns: the pipe runs on.
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
b=/tmp/bench; mkdir -p $b

visit() {
  local part=${1:?a, b, w or pipe} script=$2
  case $part in
    a)
      NO_DALI=1 source bench/device_env.sh
      nvidia-smi --query-gpu=index,name,memory.used,power.limit --format=csv,noheader
      setsid nohup bash "$script" pipe > $b/pipe.txt 2>&1 < /dev/null &
      while [ ! -e $b/STARTED ] && [ $SECONDS -lt 60 ]; do sleep 2; done
      cat $b/pipe.txt; exit 0 ;;
    b)
      bash /tmp/dali-stash/unpack.sh install && touch $b/DALI_READY
      visit w "$script" ;;
    w)
      while [ ! -e $b/PIPE_DONE ] && [ $SECONDS -lt 540 ]; do sleep 5; done
      report
      [ -e $b/PIPE_DONE ] && echo "pipe done" || echo "pipe still running: call w again"
      exit 0 ;;
    pipe)
      (sleep 30; touch $b/STARTED) &  # the pipe's first commands have imported fasttrain by then
      NO_DALI=1 source bench/device_env.sh  # DALI's path is added once it is there
      limit=${PIPE_LIMIT:-${3:?a default limit in seconds}}
      return 0 ;;
    *)
      echo "unknown part $part: a, b, w or pipe" >&2; exit 2 ;;
  esac
}

# In a pipe, go NAME: whether a run may start, the pipe's limit not passed (else it says what it
# skips). wait_for FILE: until FILE exists or the limit passes; whether it exists.
go() { [ $SECONDS -lt $limit ] || { echo "$SECONDS s: past the limit, skipped: $1"; return 1; }; }
wait_for() { while [ ! -e "$1" ] && [ $SECONDS -lt $limit ]; do sleep 2; done; [ -e "$1" ]; }
# ready_or_end: until DALI is unpacked and the sample set built; if the limit passes first, the
# pipe ends there
ready_or_end() {
  wait_for $b/DALI_READY && wait_for $b/SAMPLE || {
    echo "no DALI or no sample set"; touch $b/PIPE_DONE; exit 1; }
}
# gpu_tests GPU PYTEST_ARGS...: pytest on that GPU, its output in $b/tests.txt (report_runs shows
# its end)
gpu_tests() {
  local gpu=$1; shift
  CUDA_VISIBLE_DEVICES=$gpu python -m pytest -q -rA -p no:cacheprovider "$@" > $b/tests.txt 2>&1
}
# pair NAME0 FLAGS0 -- NAME1 FLAGS1: the two runs side by side, NAME0 on GPU 0 and NAME1 on GPU 1
pair() {
  local n0=$1; shift; local f0=(); while [ "$1" != -- ]; do f0+=("$1"); shift; done; shift
  local n1=$1; shift
  go "$n0 | $n1" && { run_on "$n0" 0 "${f0[@]}" & run_on "$n1" 1 "$@"; wait; }
}

# report_runs TARBALL [TAR OPTION ...], for a script's report(): the end of gpu_tests' output,
# if any, the pipe's progress, each run's first step and errors, each run's rates (bench/epoch_rates.py), then $b and every run's
# summary, logs, metrics and profile breakdowns in $out/TARBALL
report_runs() {
  local tarball=$1; shift
  tail -4 $b/tests.txt 2>/dev/null
  cat $b/pipe.txt 2>/dev/null
  grep -h "first step done\|Traceback\|rror\|capturing the training step failed" $b/runs-*.txt \
    2>/dev/null | cut -c1-220 | head -40
  python bench/epoch_rates.py /tmp/runs/*/ > $b/epoch_rates.jsonl 2>&1; cut -c1-300 $b/epoch_rates.jsonl
  tar -czf "$out/$tarball" "$@" -C /tmp bench $(cd /tmp && ls -d runs/*/summary.json \
    runs/*/log-rank*.txt runs/*/metrics.jsonl runs/*/profile/breakdown-rank*.json 2>/dev/null)
}

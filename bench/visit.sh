# The calls of one visit to the GPU machine, for a bench/gpu_*.sh script whose work runs in one
# background `pipe` (docs/GPU-MACHINE.md). The script sets b, defines report(), then calls
#   visit "$part" bench/gpu_NAME.sh
# a: starts `bench/gpu_NAME.sh pipe` in the background and returns once the pipe has touched
#    $b/STARTED (its first imports done before the next call copies the working tree again).
# b: unpacks DALI from the stash, marks it ready ($b/DALI_READY), then does what w does.
# w: waits up to 540 s for $b/PIPE_DONE, reports, and says whether the pipe is done.
# pipe: returns, and the script's pipe runs on.
visit() {
  local part=$1 script=$2
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
      return 0 ;;
    *)
      echo "unknown part $part: a, b, w or pipe" >&2; exit 2 ;;
  esac
}

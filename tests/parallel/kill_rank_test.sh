#!/usr/bin/env bash
# A rank of a 2-rank fp8lm run dies (SIGKILL) or hangs (SIGSTOP) mid-training: the job must
# end by itself, non-zero, within the deadline, never hang.
#   usage: kill_rank_test.sh kill|stop <deadline seconds> <mpirun command...>
set -u
mode=$1
deadline=$2
shift 2
log=$(mktemp)
start=$SECONDS
timeout --kill-after=10 "$deadline" "$@" > "$log" 2>&1 &
job=$!
# Wait for training to be under way on both ranks, then take rank 1 out.
victim=""
for _ in $(seq 1 200); do
  sleep 0.2
  grep -q "iter " "$log" || continue
  for pid in $(pgrep -f "fp8lm.*--train-iters"); do
    if tr '\0' '\n' < /proc/$pid/environ 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=1"; then victim=$pid; fi
  done
  [ -n "$victim" ] && break
done
if [ -z "$victim" ]; then
  echo "FAIL: rank 1 never started training"; cat "$log"; kill $job 2>/dev/null; exit 1
fi
if [ "$mode" = kill ]; then kill -KILL "$victim"; else kill -STOP "$victim"; fi
echo "---- rank 1 (pid $victim) sent SIG$( [ "$mode" = kill ] && echo KILL || echo STOP ) after $((SECONDS - start)) s"
wait $job
status=$?
elapsed=$((SECONDS - start))
[ "$mode" = stop ] && kill -KILL "$victim" 2>/dev/null
tail -20 "$log"
echo "---- exit status $status after ${elapsed} s (deadline ${deadline} s)"
rm -f "$log"
if [ "$status" -eq 124 ] || [ "$elapsed" -ge "$deadline" ]; then echo "FAIL: the job was still running at the deadline"; exit 1; fi
if [ "$status" -eq 0 ]; then echo "FAIL: the job exited 0"; exit 1; fi
echo "PASS: the job ended with status $status in ${elapsed} s"

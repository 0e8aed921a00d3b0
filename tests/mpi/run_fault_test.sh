#!/usr/bin/env bash
# Runs an MPI job in which one rank fails and passes only when the job ends by itself, with a
# non-zero exit status, within the deadline, and its output matches the expected pattern (so
# that an unrelated start-up failure does not pass). A hang fails the test.
#   usage: run_fault_test.sh <deadline seconds> <expected output regex> <command...>
set -u
deadline=$1
expected=$2
shift 2

start=$SECONDS
output=$(timeout --kill-after=10 "$deadline" "$@" 2>&1)
status=$?
elapsed=$((SECONDS - start))
printf '%s\n' "$output"
echo "---- exit status $status after ${elapsed} s (deadline ${deadline} s)"

# timeout(1) says 124, or 137 after --kill-after; mpirun also exits 137 when a rank died of
# SIGKILL, so the clock decides.
if [ "$status" -eq 124 ] || [ "$elapsed" -ge "$deadline" ]; then
  echo "FAIL: the job was still running at the deadline (a hang)"
  exit 1
fi
if [ "$status" -eq 0 ]; then
  echo "FAIL: the job exited 0; a failed rank must fail the job"
  exit 1
fi
if ! grep -Eq -- "$expected" <<<"$output"; then
  echo "FAIL: the output lacks /$expected/"
  exit 1
fi
echo "PASS: the job ended with status $status in ${elapsed} s"

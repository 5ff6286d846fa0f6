#!/bin/bash
# Why a many-core machine runs the group slower than 2 cores (issue 30, item 1): the same
# one-way and replied streams (3 members, shm, 1 KB, depth 32) at this machine's automatic
# settings, with spin_us 0 and send_batch 0 apart and together, on three cores and on two
# (taskset, the 2-core settings); then step timelines with and without spinning, and, where
# py-spy is installed, the top functions of member 0 at the defaults and on two cores.
# Usage: bash benchmarks/core_count_ab.sh [COUNT]   (from the repository root)
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
COUNT=${1:-30000}
lscpu | grep -iE "model name|^cpu\(s\)" | sed -E 's/  +/ /g'
echo "== per-core speed (timeit, lower is faster)"
$PY -m timeit -s "d={i:i for i in range(1000)}" "sum(d[i] for i in range(1000))"
S="timeout 60 $PY benchmarks/shm_stream.py --count $COUNT"
ab() { local label="$1"; shift; echo "-- $label: $("$@" 2>&1 | tail -1 | sed -E 's/^shm, 3 members, [^:]*: //')"; }
for mode in "--one-way" ""; do
  echo "== stream ${mode:-replied}, 3 senders, depth 32"
  ab "all cores, automatic settings" $S $mode
  ab "all cores, spin 0" $S $mode --spin-us 0
  ab "all cores, send_batch 0" $S $mode --send-batch 0
  ab "all cores, spin 0, send_batch 0" $S $mode --spin-us 0 --send-batch 0
  ab "cores 0-2, automatic settings" taskset -c 0-2 $S $mode
  ab "cores 0-1, spin 0, send_batch 0" taskset -c 0-1 $S $mode --spin-us 0 --send-batch 0
done
echo "== step timelines (one-way, depth 1)"
for v in "" "--spin-us 0"; do
  echo "-- all cores ${v:-automatic settings}"
  timeout 100 $PY benchmarks/latency_timeline.py --calls 3000 $v 2>&1 | tail -22
done
if command -v py-spy >/dev/null; then
  for v in "" "taskset -c 0-1"; do
    echo "== py-spy, one-way stream, ${v:-all cores}"
    extra=(); [ -n "$v" ] && extra=(--spin-us 0 --send-batch 0)
    timeout 120 $v py-spy record --subprocesses --gil -r 400 --format raw -o /tmp/core_ab_raw.txt \
        -- $S --one-way "${extra[@]}" > /dev/null 2>&1
    $PY benchmarks/pyspy_top.py /tmp/core_ab_raw.txt --one --top 25 2>&1 | head -60
  done
fi

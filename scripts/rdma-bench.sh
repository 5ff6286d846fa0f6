#!/usr/bin/env bash
# Benchmark tables for shm, tcp and rdma from one run inside rxe-vm (Soft-RoCE; emulated CPU:
# compare behaviour, not absolute speed), then large payloads (one sender) over tcp and rdma.
#
#   scripts/rdma-bench.sh [small messages per sender (default 2000; 0 skips)] [large sizes...]
#   e.g. scripts/rdma-bench.sh 2000 16777216 67108864
#
# Large runs use a long suspicion timeout: on the emulated CPU a member handling a large
# payload can miss heartbeats for seconds. Needs what scripts/rdma-tests.sh needs.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$(pwd -P)
RXE_VM=${RXE_VM_TOOL:-$ROOT/../shared/tools/rxe-vm}
MSGS=${1:-2000}
shift || true
SIZES=${*:-16777216}
export RXE_VM_TIMEOUT=${RXE_VM_TIMEOUT:-1800}
"$ROOT/.venv/bin/python" -m compileall -q -j 0 "$ROOT/derecho_async" > /dev/null 2>&1 || true
exec "$RXE_VM" bash -c '
    bench=".venv/bin/derecho-async bench --members 3 --timeout 900"
    if [ '"$MSGS"' -gt 0 ]; then
        for t in shm tcp rdma; do
            echo "== small messages: $t"
            $bench --transport $t --messages '"$MSGS"' --size 64 || echo "($t failed)"
        done
    fi
    for size in '"$SIZES"'; do
        n=$(( size >= 64 << 20 ? 2 : 4 ))
        for t in tcp rdma; do
            echo "== large payloads: $t, one sender, $n x $size bytes"
            start=$(date +%s.%N)
            $bench --transport $t --senders 1 --messages $n --size $size --depth 1 \
                --heartbeat-ms 100 --suspect-after-ms 30000 || echo "($t failed)"
            echo "(wall $(echo "$(date +%s.%N) - $start" | bc) s, group start and stop included)"
        done
    done
'

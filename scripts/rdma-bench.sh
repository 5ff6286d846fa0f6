#!/usr/bin/env bash
# Benchmark tables for shm, tcp and rdma from one run inside rxe-vm (Soft-RoCE; emulated CPU:
# compare behaviour, not absolute speed), plus a large-payload run over tcp and rdma.
#
#   scripts/rdma-bench.sh [messages per sender, default 2000] [large size, default 16777216]
#
# Needs what scripts/rdma-tests.sh needs (the project venv, rxe-vm and its packages).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$(pwd -P)
RXE_VM=${RXE_VM_TOOL:-$ROOT/../shared/tools/rxe-vm}
MSGS=${1:-2000}
BIG=${2:-16777216}
export RXE_VM_TIMEOUT=${RXE_VM_TIMEOUT:-1800}
"$ROOT/.venv/bin/python" -m compileall -q -j 0 "$ROOT/derecho_async" > /dev/null 2>&1 || true
exec "$RXE_VM" bash -c '
    bench=".venv/bin/derecho-async bench"
    for t in shm tcp rdma; do
        echo "== small messages: $t"
        $bench --transport $t --members 3 --messages '"$MSGS"' --size 64 --timeout 600 || echo "($t failed)"
    done
    for t in tcp rdma; do
        echo "== large payloads: $t, one sender, '"$BIG"' bytes each"
        $bench --transport $t --members 3 --senders 1 --messages 6 --size '"$BIG"' --depth 2 \
            --timeout 600 || echo "($t failed)"
    done
'

#!/usr/bin/env bash
# Run the rdma-marked tests on real verbs: Soft-RoCE (rdma_rxe) inside a qemu VM (rxe-vm).
#
#   scripts/rdma-tests.sh [extra pytest args]      e.g. scripts/rdma-tests.sh -k conformance
#
# Installs the Debian packages rxe-vm needs when they are missing (apt-get; needs root), then runs
#   rxe-vm .venv/bin/pytest -m rdma tests/transport -q
# from the repository root: rxe-vm shares the current directory read-write with the guest and
# the rest of the host filesystem read-only, so the project's .venv works unchanged inside.
# Exit status: pytest's. When the VM cannot start (rxe-vm exits 125, or the tools cannot be
# installed) it prints why and reports the rdma tests as SKIPPED with exit status 0 -- never a
# silent pass: the last line says which of PASSED / FAILED / SKIPPED happened.
# Knobs: RXE_VM_TIMEOUT (seconds, default 3600), RXE_VM_CPUS, RXE_VM_MEM (see rxe-vm).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
ROOT=$(pwd -P)
RXE_VM=${RXE_VM_TOOL:-$ROOT/../shared/tools/rxe-vm}
PY=$ROOT/.venv/bin/python
PACKAGES=(qemu-system-x86 linux-image-amd64 busybox-static cpio xz-utils kmod iproute2 rdma-core
          ibverbs-providers ibverbs-utils perftest rdmacm-utils python3-pyverbs)

skipped() {
    echo "rdma-tests: $*" >&2
    echo "rdma-tests: SKIPPED: the rdma tests did not run (reason above)"
    exit 0
}

[ -x "$RXE_VM" ] || skipped "rxe-vm not found at $RXE_VM (set RXE_VM_TOOL)"
[ -x "$PY" ] || skipped "no project venv at $PY (run 'make test' once to create it)"

missing=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "rdma-tests: installing ${missing[*]}"
    if [ "$(id -u)" != 0 ]; then
        skipped "packages missing (${missing[*]}) and not root to install them"
    fi
    if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
            --no-install-recommends "${missing[@]}"; } >&2; then
        skipped "apt-get could not install ${missing[*]}"
    fi
fi

# Python inside the emulated CPU is slow: compile once here (the guest reads the .pyc files).
"$PY" -m compileall -q -j 0 "$ROOT/derecho_async" "$ROOT/tests" > /dev/null 2>&1 || true

export RXE_VM_TIMEOUT=${RXE_VM_TIMEOUT:-3600}
errlog=$(mktemp "${TMPDIR:-/tmp}/rdma-tests.XXXXXX")
trap 'rm -f "$errlog"' EXIT
# stdout straight through; stderr through tee, kept to tell a timeout from a VM that never started
{
    "$RXE_VM" "$PY" -m pytest -m rdma tests/transport -q -p no:cacheprovider "$@" \
        2>&1 1>&3 3>&- | tee "$errlog" 1>&2 3>&-
    rc=${PIPESTATUS[0]}
} 3>&1
case $rc in
    0) echo "rdma-tests: PASSED (inside rxe-vm)" ;;
    5) echo "rdma-tests: FAILED: pytest collected no rdma tests (exit 5)" ;;
    125)
        if grep -q "rxe-vm: timed out" "$errlog"; then
            echo "rdma-tests: FAILED: the tests did not finish within RXE_VM_TIMEOUT=${RXE_VM_TIMEOUT}s"
            exit 124
        fi
        skipped "the VM could not start (rxe-vm exit 125; rerun with RXE_VM_VERBOSE=1 for the console)"
        ;;
    *) echo "rdma-tests: FAILED (pytest exit status $rc)" ;;
esac
exit "$rc"

"""Which GPU planes a member runs: a pure decision over probes for CuPy, a device and NCCL.

Theory of operation (DESIGN.md §6.2). The driver asks :func:`select_gpu_planes` once, at
start-up, for the planes it tries first, in order; the decision is pure (tested on the CPU) and
calls the probes :func:`gpu_available` and :func:`nccl_unavailable` only when it needs them.
Each probe imports CuPy only when it is called. A GPU mode asked for explicitly that cannot run
here is a :class:`~derecho_async.errors.UsageError`.
"""

from __future__ import annotations

from collections.abc import Callable

from derecho_async.errors import UsageError

__all__ = ["gpu_available", "nccl_unavailable", "select_gpu_planes"]


def select_gpu_planes(mode: str, one_host: bool, gpu: Callable[[], bool],
                      nccl: Callable[[], str | None]) -> tuple[str, ...]:
    """The GPU planes a member runs, in the order the driver tries them.

    ``mode`` is :attr:`Config.gpu_plane`; ``one_host`` says whether the transport keeps every
    member on one host (shm); ``gpu()`` says whether CuPy sees a device and ``nccl()`` why NCCL
    cannot be used here (None: it can); each is called only when needed.
    "host": none. "ipc": CUDA IPC. "auto": CUDA IPC on one host when there is a device (as
    before NCCL existed: the IPC path is unchanged). "nccl": NCCL, then CUDA IPC on one host for what
    NCCL does not take (members sharing a GPU, communicators not up yet). A mode asked for
    explicitly that cannot run raises :class:`UsageError`.
    """
    if mode == "host":
        return ()
    if mode == "nccl":
        why = nccl()
        if why is not None:
            raise UsageError(
                f"gpu_plane='nccl' needs CuPy with NCCL (cupy.cuda.nccl, 2.4 or later) and a "
                f"CUDA device on this member: {why}"
            )
        return ("nccl", "ipc") if one_host else ("nccl",)
    if mode == "ipc":
        if not gpu():
            raise UsageError("gpu_plane='ipc' needs CuPy and a CUDA device on this member")
        return ("ipc",)
    return ("ipc",) if one_host and gpu() else ()


def gpu_available() -> bool:
    """Whether CuPy imports here and sees at least one CUDA device."""
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:
        return False


def nccl_unavailable() -> str | None:
    """Why NCCL cannot be used here (no CuPy, no device, no NCCL, NCCL too old), or None."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
        from cupy.cuda import nccl

        if not getattr(nccl, "available", True):
            return "CuPy was built or installed without NCCL"
        version = int(nccl.get_version())
    except Exception as exc:  # ImportError, CUDA driver errors, a missing libnccl
        return repr(exc)
    if version < 2400:
        return f"NCCL {version} has no ncclCommAbort (2.4 or later is needed)"
    return None

"""Which GPU planes a member can run: probes for CuPy and a device.

Theory of operation (DESIGN.md §6.2). The driver asks these once, at start-up, when
``Config.gpu_plane`` may want a GPU plane; each probe imports CuPy only when it is called.
"""

from __future__ import annotations

__all__ = ["gpu_available"]


def gpu_available() -> bool:
    """Whether CuPy imports here and sees at least one CUDA device."""
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:
        return False

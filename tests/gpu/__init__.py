"""GPU tests: collected everywhere, skipped with the reason where no GPU is available."""

from __future__ import annotations

from typing import Any

import pytest


def need_cupy() -> Any:
    """The cupy module, or skip the test (with the reason) where CuPy or a CUDA device is
    missing."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception as exc:  # ImportError, CUDA driver errors
        pytest.skip(f"CuPy with a CUDA device is needed: {exc}")
    return cupy

"""A bytes object of a buffer: the pure twin of ``native/bytescopy.c`` (docs/DESIGN.md §8.1)."""

from __future__ import annotations

__all__ = ["bytes_copy"]


def bytes_copy(buffer: object, /) -> bytes:
    """A new bytes object holding the bytes of ``buffer`` (anything with the buffer protocol;
    a non-contiguous one in C order). The native twin copies a large buffer with the GIL
    released, so a worker thread converting hundreds of MiB does not hold up the event loop;
    here the copy holds the GIL."""
    try:
        view = memoryview(buffer)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"bytes_copy: a bytes-like object is required, not '{type(buffer).__name__}'"
        ) from None
    return bytes(view)

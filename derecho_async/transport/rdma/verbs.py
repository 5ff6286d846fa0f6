# Theory of operation
# -------------------
# The only module that touches pyverbs, which is untyped and version-sensitive: discovery
# (``load_pyverbs``: the interpreter's own pyverbs, else the distribution's copy loaded by path
# without touching ``sys.path``), device and GID choice (``choose_port``), the completion
# channel's descriptor (``comp_channel_fd``), host buffers for registration, and an unverified
# GPUDirect dma-buf registration (``register_device_memory``). Everything pyverbs returns is
# ``Any``; the rest of the package sees the small typed surface below. See docs/DESIGN.md §5.4
# (pyverbs).
"""pyverbs discovery, device selection and small typed wrappers for the rdma transport."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import importlib
import importlib.machinery
import importlib.util
import ipaddress
import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from derecho_async.errors import DerechoError

__all__ = [
    "DevicePort",
    "DeviceRegistration",
    "HostBuffer",
    "Pyverbs",
    "RdmaUnavailable",
    "choose_port",
    "comp_channel_fd",
    "load_pyverbs",
    "register_device_memory",
    "select_registration_path",
]

#: Where Debian/Ubuntu install python3-pyverbs.
DIST_PACKAGES = "/usr/lib/python3/dist-packages"

FIX_PYVERBS = (
    "install the distribution's pyverbs matching the system rdma-core "
    "(Debian/Ubuntu: apt-get install python3-pyverbs rdma-core ibverbs-providers); the PyPI "
    "'pyverbs' wheel only works with the identical rdma-core version installed system-wide"
)
FIX_DEVICE = (
    "no RDMA device found: load a driver for your NIC, or for a software device run "
    "'rdma link add rxe0 type rxe netdev <if>' (Soft-RoCE; module rdma_rxe); "
    "'ibv_devices' lists what libibverbs sees"
)


class RdmaUnavailable(DerechoError):
    """RDMA cannot be used here; the message says why and how to fix it."""


@dataclass(frozen=True)
class Pyverbs:
    """The pyverbs modules the transport uses (all untyped)."""

    root: ModuleType
    device: Any
    pd: Any
    cq: Any
    mr: Any
    qp: Any
    wr: Any
    addr: Any
    enums: Any
    error: Any
    origin: str

    @property
    def rdma_error(self) -> type[BaseException]:
        """pyverbs' ``PyverbsRDMAError`` (carries ``error_code``)."""
        cls: type[BaseException] = self.error.PyverbsRDMAError
        return cls

    @property
    def any_error(self) -> type[BaseException]:
        """pyverbs' base error class (``PyverbsError``)."""
        cls: type[BaseException] = self.error.PyverbsError
        return cls


_lock = threading.Lock()
_cached: Pyverbs | None = None
_SUBMODULES = ("device", "pd", "cq", "mr", "qp", "wr", "addr", "pyverbs_error")


def _import_normally() -> ModuleType:
    return importlib.import_module("pyverbs")


def _import_from(directory: str) -> ModuleType:
    """Import the package ``pyverbs`` found in ``directory`` without touching ``sys.path``.

    Its submodules are then found through the package's own ``__path__``.
    """
    spec = importlib.machinery.PathFinder.find_spec("pyverbs", [directory])
    if spec is None or spec.loader is None:
        raise ImportError(f"no pyverbs package in {directory}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["pyverbs"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop("pyverbs", None)
        raise
    return module


def _load(
    import_normally: Callable[[], ModuleType] = _import_normally,
    import_from: Callable[[str], ModuleType] = _import_from,
    dist_packages: str = DIST_PACKAGES,
) -> Pyverbs:
    """Find pyverbs (see the module header); raise :class:`RdmaUnavailable` naming the fix."""
    first: BaseException | None = None
    try:
        root = import_normally()
        origin = "sys.path"
    except ImportError as exc:
        first = exc
        candidate = os.path.join(dist_packages, "pyverbs")
        if not os.path.isdir(candidate):
            raise RdmaUnavailable(f"pyverbs is not installed ({exc}): {FIX_PYVERBS}") from exc
        try:
            root = import_from(dist_packages)
        except ImportError as exc2:
            raise RdmaUnavailable(
                f"pyverbs in {candidate} cannot be loaded by Python "
                f"{sys.version_info.major}.{sys.version_info.minor} ({exc2}): {FIX_PYVERBS}"
            ) from exc2
        origin = candidate
    try:
        subs = {name: importlib.import_module(f"pyverbs.{name}") for name in _SUBMODULES}
        try:
            enums = importlib.import_module("pyverbs.libibverbs_enums")
        except ImportError:
            enums = importlib.import_module("pyverbs.enums")
    except ImportError as exc:
        why = f"{exc}" if first is None else f"{exc}; first attempt: {first}"
        raise RdmaUnavailable(
            f"pyverbs found at {origin} but its modules do not load ({why}): {FIX_PYVERBS}"
        ) from exc
    return Pyverbs(
        root=root,
        device=subs["device"],
        pd=subs["pd"],
        cq=subs["cq"],
        mr=subs["mr"],
        qp=subs["qp"],
        wr=subs["wr"],
        addr=subs["addr"],
        enums=enums,
        error=subs["pyverbs_error"],
        origin=origin,
    )


def load_pyverbs() -> Pyverbs:
    """The pyverbs modules (loaded once); raises :class:`RdmaUnavailable` naming the fix."""
    global _cached
    with _lock:
        if _cached is None:
            _cached = _load()
        return _cached


# -- device / port / GID choice ---------------------------------------------------------------


@dataclass(frozen=True)
class DevicePort:
    """The local RDMA endpoint the transport uses."""

    device: str
    port: int
    gid_index: int
    gid: bytes  # 16 bytes
    lid: int
    link_layer_ethernet: bool
    active_mtu: int  # an IBV_MTU_* enum value


@dataclass(frozen=True)
class _PortInfo:
    state_active: bool
    ethernet: bool
    lid: int
    active_mtu: int
    gid_table_len: int


def gid_to_bytes(text: str) -> bytes:
    """pyverbs' GID text (``xxxx:xxxx:...``, 8 groups) as 16 bytes."""
    parts = text.split(":")
    if len(parts) != 8 or not all(len(p) == 4 for p in parts):
        raise ValueError(f"unexpected GID text {text!r}")
    return bytes.fromhex("".join(parts))


def gid_to_text(raw: bytes) -> str:
    """16 GID bytes in pyverbs' text form."""
    if len(raw) != 16:
        raise ValueError("a GID is 16 bytes")
    h = raw.hex()
    return ":".join(h[i : i + 4] for i in range(0, 32, 4))


def is_ipv4_mapped(gid: bytes) -> bool:
    """True for a GID of the form ``::ffff:a.b.c.d`` (the RoCE v2 IPv4 GIDs)."""
    return len(gid) == 16 and ipaddress.IPv6Address(gid).ipv4_mapped is not None


def pick_gid_index(gids: list[tuple[int, bytes, str]], ethernet: bool) -> int | None:
    """From (index, gid, type) triples, the index to use (None if none is usable).

    RoCE (``ethernet``): the first RoCE v2 GID carrying an IPv4 address, else the first RoCE v2
    GID, else the first non-zero GID. InfiniBand: index 0 when it is non-zero.
    """
    nonzero = [(i, g, t) for i, g, t in gids if any(g)]
    if not ethernet:
        return next((i for i, _, _ in nonzero if i == 0), None)
    v2 = [(i, g) for i, g, t in nonzero if t.replace(" ", "").lower() == "rocev2"]
    for i, g in v2:
        if is_ipv4_mapped(g):
            return i
    if v2:
        return v2[0][0]
    return nonzero[0][0] if nonzero else None


def _gid_type_sysfs(device: str, port: int, index: int) -> str:
    path = f"/sys/class/infiniband/{device}/ports/{port}/gid_attrs/types/{index}"
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _port_info(pv: Pyverbs, ctx: Any, port: int) -> _PortInfo:
    attr = ctx.query_port(port)
    e = pv.enums
    return _PortInfo(
        state_active=int(attr.state) == int(e.IBV_PORT_ACTIVE),
        ethernet=int(attr.link_layer) == int(e.IBV_LINK_LAYER_ETHERNET),
        lid=int(attr.lid),
        active_mtu=int(attr.active_mtu),
        gid_table_len=int(attr.gid_tbl_len),
    )


def list_devices(pv: Pyverbs) -> list[str]:
    """Names of the RDMA devices libibverbs sees."""
    names = []
    try:
        devices = pv.device.get_device_list()
    except pv.any_error as exc:  # e.g. a kernel without RDMA support
        raise RdmaUnavailable(f"{FIX_DEVICE} ({exc})") from exc
    for dev in devices:
        name = dev.name
        names.append(name.decode() if isinstance(name, bytes) else str(name))
    return names


def choose_port(
    pv: Pyverbs, device: str | None = None, port: int = 1, gid_index: int | None = None
) -> tuple[Any, DevicePort]:
    """Open the device and pick (port, GID index); returns (pyverbs Context, choice).

    ``device`` None picks the first device whose ``port`` is active. Raises
    :class:`RdmaUnavailable` when there is no device, no such device, or no active port.
    """
    names = list_devices(pv)
    if not names:
        raise RdmaUnavailable(FIX_DEVICE)
    if device is not None and device not in names:
        raise RdmaUnavailable(
            f"RDMA device {device!r} not found (devices: {', '.join(names)}); "
            "set rdma_device to one of them or leave it unset"
        )
    candidates = [device] if device is not None else names
    inactive: list[str] = []
    for name in candidates:
        ctx = pv.device.Context(name=name)
        try:
            info = _port_info(pv, ctx, port)
        except pv.any_error as exc:
            ctx.close()
            inactive.append(f"{name} port {port}: {exc}")
            continue
        if not info.state_active:
            ctx.close()
            inactive.append(f"{name} port {port} is not active")
            continue
        try:
            gids = []
            for i in range(info.gid_table_len if gid_index is None else 0):
                try:
                    g = gid_to_bytes(ctx.query_gid(port, i).gid)
                except (pv.any_error, ValueError):
                    continue
                gids.append((i, g, _gid_type_sysfs(name, port, i)))
                if len(gids) >= 256:
                    break
            idx = gid_index if gid_index is not None else pick_gid_index(gids, info.ethernet)
            if idx is None:
                raise RdmaUnavailable(
                    f"RDMA device {name} port {port} has no usable GID (RoCE needs an IP "
                    "address on the underlying interface); set rdma_gid_index"
                )
            try:
                gid = gid_to_bytes(ctx.query_gid(port, idx).gid)
            except (pv.any_error, ValueError) as exc:
                raise RdmaUnavailable(
                    f"GID index {idx} of {name} port {port} is not readable ({exc}); "
                    "set rdma_gid_index to a valid index (see 'show_gids')"
                ) from exc
        except BaseException:
            ctx.close()
            raise
        return ctx, DevicePort(name, port, idx, gid, info.lid, info.ethernet, info.active_mtu)
    raise RdmaUnavailable(
        "no active RDMA port: " + "; ".join(inactive) + " (check 'ibv_devinfo'; the link must "
        "be up, and for RoCE the netdev must be up)"
    )


# -- completion channel file descriptor -------------------------------------------------------

_EVENT_FD_NAME = "anon_inode:[infinibandevent]"


def _fd_targets() -> dict[int, str]:
    out = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return out


def comp_channel_fd(create: Callable[[], Any]) -> tuple[Any, int | None]:
    """Create a completion channel with ``create()`` and find its file descriptor.

    Uses the channel's ``fd`` attribute when pyverbs has one; otherwise the one new descriptor
    named ``anon_inode:[infinibandevent]``. Returns (channel, fd or None when not found).
    """
    before = _fd_targets()
    channel = create()
    fd = getattr(channel, "fd", None)
    if isinstance(fd, int) and fd >= 0:
        return channel, fd
    after = _fd_targets()
    new = [fd for fd, t in after.items() if t == _EVENT_FD_NAME and before.get(fd) != t]
    return channel, new[0] if len(new) == 1 else None


def set_nonblocking(fd: int) -> None:
    """Make ``fd`` non-blocking (ibv_get_cq_event then fails with EAGAIN instead of waiting)."""
    os.set_blocking(fd, False)


def is_eagain(pv: Pyverbs, exc: BaseException) -> bool:
    """True when a pyverbs error reports EAGAIN/EWOULDBLOCK."""
    code = getattr(exc, "error_code", None)
    return code in (errno.EAGAIN, errno.EWOULDBLOCK)


# -- memory ------------------------------------------------------------------------------------


class HostBuffer:
    """Page-aligned anonymous memory (an ``mmap``) and its address, for registration.

    Read and write it through :attr:`mm` (slicing an mmap copies, so no buffer export outlives
    a call and :meth:`close` always succeeds).
    """

    def __init__(self, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError("nbytes must be positive")
        size = (nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        self.nbytes = nbytes
        self.mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # the temporary ctypes object holds a buffer export only for this expression
        self.address: int = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self.mm.closed

    def close(self) -> None:
        """Unmap the memory; call only after every MR over it was deregistered."""
        if not self.mm.closed:
            with contextlib.suppress(BufferError):
                self.mm.close()


# -- GPUDirect registration --------------------------------------------------------------------


@dataclass
class DeviceRegistration:
    """The outcome of :func:`register_device_memory`.

    ``path`` is ``"dmabuf"`` (the NIC reads/writes GPU memory directly) or ``"staging"`` (a
    pinned host buffer of the same size is registered; the caller copies between it and the GPU
    buffer). ``mr`` is the pyverbs MR; ``staging`` the host buffer for the staging path;
    ``reason`` why dma-buf was not used.
    """

    path: str
    mr: Any
    nbytes: int
    staging: HostBuffer | None = None
    reason: str = ""
    dmabuf_fd: int | None = None

    def close(self) -> None:
        """Deregister and free what this registration owns."""
        with contextlib.suppress(Exception):
            self.mr.close()
        if self.staging is not None:
            self.staging.close()
        if self.dmabuf_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.dmabuf_fd)
            self.dmabuf_fd = None


def _cuda_dmabuf_exporter() -> tuple[Callable[[int, int], int] | None, str]:
    """A function (ptr, nbytes) -> dma-buf fd, from cuda-python or CuPy; or (None, why)."""
    try:
        from cuda import cuda  # type: ignore[import-not-found,unused-ignore]

        def export_cuda_python(ptr: int, nbytes: int) -> int:
            handle_type = cuda.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
            err, fd = cuda.cuMemGetHandleForAddressRange(ptr, nbytes, handle_type, 0)
            if int(err) != 0:
                raise OSError(f"cuMemGetHandleForAddressRange failed: {err}")
            return int(fd)

        return export_cuda_python, ""
    except ImportError:
        pass
    try:
        import cupy  # type: ignore[import-not-found,unused-ignore]

        driver = cupy.cuda.driver
        fn = getattr(driver, "memGetHandleForAddressRange", None)
        if fn is None:
            return None, "CuPy has no memGetHandleForAddressRange and cuda-python is missing"

        def export_cupy(ptr: int, nbytes: int) -> int:
            # CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD == 1
            return int(fn(ptr, nbytes, 1, 0))

        return export_cupy, ""
    except ImportError:
        return None, "neither cuda-python nor CuPy is installed"


def select_registration_path(
    *,
    is_gpu: bool,
    exporter_available: bool,
    dmabuf_mr_available: bool,
    aligned: bool,
) -> tuple[str, str]:
    """Decide between ``"dmabuf"`` and ``"staging"``; returns (path, reason for staging).

    dma-buf needs: GPU memory, a CUDA dma-buf exporter, pyverbs ``DmaBufMR`` (rdma-core >= 34)
    and a range aligned to the GPU page size (64 KiB). Host memory never needs staging, but the
    caller registers it as a plain MR: that is reported as ``"host"``.
    """
    if not is_gpu:
        return "host", "host memory: registered directly"
    if not exporter_available:
        return "staging", "no CUDA dma-buf exporter (install cuda-python or CuPy >= 13)"
    if not dmabuf_mr_available:
        return "staging", "this pyverbs has no DmaBufMR (rdma-core >= 34 needed)"
    if not aligned:
        return "staging", "range not aligned to the 64 KiB GPU page size"
    return "dmabuf", ""


GPU_PAGE = 1 << 16


def gpu_path_summary(pv: Pyverbs) -> str:
    """One line for the start-up log: which path GPU payloads take over this transport.

    The data plane stages device arrays through host memory before handing them to the
    transport, so that is the path in use; the line also says whether dma-buf registration
    (GPUDirect, :func:`register_device_memory`) could be used here, without importing CUDA."""
    import importlib.util

    exporter = False
    for name in ("cuda", "cupy"):
        with contextlib.suppress(ImportError, ValueError):
            exporter = exporter or importlib.util.find_spec(name) is not None
    path, reason = select_registration_path(
        is_gpu=True,
        exporter_available=exporter,
        dmabuf_mr_available=hasattr(pv.mr, "DmaBufMR"),
        aligned=True,
    )
    if path == "dmabuf":
        possible = "dma-buf registration possible here but UNVERIFIED and not used"
    else:
        possible = f"no dma-buf registration: {reason}"
    return f"staged through host memory by the data plane ({possible})"


def register_device_memory(
    pd: Any,
    pointer: int,
    nbytes: int,
    *,
    is_gpu: bool,
    access: int | None = None,
    pv: Pyverbs | None = None,
) -> DeviceRegistration:
    """Register ``nbytes`` at ``pointer`` for RDMA: GPU memory via dma-buf when possible.

    Paths, in order: ``"dmabuf"`` -- export the CUDA range as a dma-buf fd
    (``cuMemGetHandleForAddressRange``) and register it with pyverbs ``DmaBufMR``;
    ``"staging"`` -- register a pinned host buffer of ``nbytes`` instead (the caller copies);
    ``"host"`` -- ``pointer`` is host memory and is registered directly. A dma-buf attempt that
    fails (driver without dma-buf support: EOPNOTSUPP, EINVAL) falls back to staging, with the
    error in ``reason``. UNVERIFIED on real hardware (no GPU + RDMA machine was available).
    """
    pv = pv or load_pyverbs()
    e = pv.enums
    if access is None:
        access = (
            int(e.IBV_ACCESS_LOCAL_WRITE)
            | int(e.IBV_ACCESS_REMOTE_WRITE)
            | int(e.IBV_ACCESS_REMOTE_READ)
        )
    exporter, why = _cuda_dmabuf_exporter() if is_gpu else (None, "")
    path, reason = select_registration_path(
        is_gpu=is_gpu,
        exporter_available=exporter is not None,
        dmabuf_mr_available=hasattr(pv.mr, "DmaBufMR"),
        aligned=pointer % GPU_PAGE == 0,
    )
    if path == "staging" and why:
        reason = why
    if path == "host":
        mr = pv.mr.MR(pd, nbytes, access, address=pointer)
        return DeviceRegistration("host", mr, nbytes, reason=reason)
    if path == "dmabuf":
        assert exporter is not None
        fd: int | None = None
        try:
            span = (nbytes + GPU_PAGE - 1) // GPU_PAGE * GPU_PAGE
            fd = exporter(pointer, span)
            mr = pv.mr.DmaBufMR(pd, nbytes, access, dmabuf=fd, offset=0)
            return DeviceRegistration("dmabuf", mr, nbytes, dmabuf_fd=fd)
        except (OSError, pv.any_error, RuntimeError, TypeError, ValueError) as exc:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
            reason = f"dma-buf registration failed ({type(exc).__name__}: {exc})"
    staging = HostBuffer(nbytes)
    try:
        mr = pv.mr.MR(pd, nbytes, access, address=staging.address)
    except BaseException:
        staging.close()
        raise
    return DeviceRegistration("staging", mr, nbytes, staging=staging, reason=reason)


def iter_chunks(total: int, limit: int) -> Iterator[tuple[int, int]]:
    """(start, length) pieces of at most ``limit`` bytes covering ``[0, total)``."""
    pos = 0
    while pos < total:
        n = min(limit, total - pos)
        yield pos, n
        pos += n

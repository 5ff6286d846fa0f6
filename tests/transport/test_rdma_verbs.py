"""The rdma verbs layer without a device: pyverbs discovery, choosing a port and GID, and
the GPU registration path (dma-buf or pinned staging), over fake pyverbs modules."""

from __future__ import annotations

import contextlib
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from derecho_async.errors import DerechoError
from derecho_async.transport.rdma import verbs

# -- discovery ---------------------------------------------------------------------------------


def test_discovery_without_pyverbs_names_the_fix(tmp_path: Path) -> None:
    def missing() -> types.ModuleType:
        raise ImportError("No module named 'pyverbs'")

    with pytest.raises(verbs.RdmaUnavailable, match="python3-pyverbs") as info:
        verbs._load(missing, verbs._import_from, str(tmp_path))
    assert "identical rdma-core" in str(info.value)
    assert isinstance(info.value, DerechoError)


def test_discovery_when_the_distribution_copy_does_not_load(tmp_path: Path) -> None:
    (tmp_path / "pyverbs").mkdir()

    def missing() -> types.ModuleType:
        raise ImportError("nope")

    def broken(directory: str) -> types.ModuleType:
        raise ImportError("undefined symbol: ibv_foo")

    with pytest.raises(verbs.RdmaUnavailable, match="cannot be loaded by Python") as info:
        verbs._load(missing, broken, str(tmp_path))
    assert "undefined symbol" in str(info.value) and "python3-pyverbs" in str(info.value)


@contextlib.contextmanager
def _fake_pyverbs(tmp_path: Path, enum_module: str) -> Any:
    pkg = tmp_path / "pyverbs"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("FAKE = True\n")
    for name in ("device", "pd", "cq", "mr", "qp", "wr", "addr", "pyverbs_error"):
        (pkg / f"{name}.py").write_text(f"NAME = {name!r}\n")
    (pkg / f"{enum_module}.py").write_text("IBV_WC_SUCCESS = 0\n")
    saved = {k: v for k, v in sys.modules.items() if k == "pyverbs" or k.startswith("pyverbs.")}
    for k in saved:
        del sys.modules[k]
    path_before = list(sys.path)
    try:
        yield str(tmp_path)
    finally:
        for k in [k for k in sys.modules if k == "pyverbs" or k.startswith("pyverbs.")]:
            del sys.modules[k]
        sys.modules.update(saved)
        assert sys.path == path_before, "discovery must not touch sys.path"


@pytest.mark.parametrize("enum_module", ["enums", "libibverbs_enums"])
def test_discovery_loads_the_distribution_copy_by_path(tmp_path: Path, enum_module: str) -> None:
    def missing() -> types.ModuleType:
        raise ImportError("No module named 'pyverbs'")

    with _fake_pyverbs(tmp_path, enum_module) as where:
        pv = verbs._load(missing, verbs._import_from, where)
        assert pv.root.FAKE is True
        assert pv.enums.__name__ == f"pyverbs.{enum_module}"
        assert pv.origin == os.path.join(where, "pyverbs")
        assert where not in sys.path


class _FakeCtx:
    def __init__(self, active: bool, gids: list[str], ethernet: bool = True) -> None:
        self.active, self.gids, self.ethernet = active, gids, ethernet
        self.closed = False

    def query_port(self, port: int) -> Any:
        return types.SimpleNamespace(
            state=4 if self.active else 1,
            link_layer=1 if self.ethernet else 0,
            lid=0,
            active_mtu=5,
            gid_tbl_len=len(self.gids),
        )

    def query_gid(self, port: int, index: int) -> Any:
        return types.SimpleNamespace(gid=self.gids[index])

    def close(self) -> None:
        self.closed = True


def _fake_pv(devices: dict[str, _FakeCtx]) -> Any:
    class Err(Exception):
        pass

    e = types.SimpleNamespace(IBV_PORT_ACTIVE=4, IBV_LINK_LAYER_ETHERNET=1)
    device = types.SimpleNamespace(
        get_device_list=lambda: [types.SimpleNamespace(name=n.encode()) for n in devices],
        Context=lambda name: devices[name],
    )
    error = types.SimpleNamespace(PyverbsError=Err, PyverbsRDMAError=Err)
    return verbs.Pyverbs(
        root=types.ModuleType("pyverbs"),
        device=device,
        pd=None,
        cq=None,
        mr=None,
        qp=None,
        wr=None,
        addr=None,
        enums=e,
        error=error,
        origin="fake",
    )


V6 = "fe80:0000:0000:0000:7078:8eff:fe7b:e769"
V4 = "0000:0000:0000:0000:0000:ffff:c000:0201"


def test_choose_port_errors_name_the_fix() -> None:
    with pytest.raises(verbs.RdmaUnavailable, match="rdma link add"):
        verbs.choose_port(_fake_pv({}))
    broken = _fake_pv({})

    def no_list() -> list[Any]:
        raise broken.any_error("Failed to get devices list")

    broken.device.get_device_list = no_list
    with pytest.raises(verbs.RdmaUnavailable, match=r"rdma link add.*Failed to get devices"):
        verbs.choose_port(broken)
    with pytest.raises(verbs.RdmaUnavailable, match="not found"):
        verbs.choose_port(_fake_pv({"mlx5_0": _FakeCtx(True, [V6])}), device="rxe9")
    idle = _FakeCtx(False, [V6])
    with pytest.raises(verbs.RdmaUnavailable, match="no active RDMA port") as info:
        verbs.choose_port(_fake_pv({"rxe0": idle}))
    assert "ibv_devinfo" in str(info.value) and idle.closed


def test_choose_port_prefers_an_active_device_and_a_roce_v2_ipv4_gid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    types_ = {0: "IB/RoCE v1", 1: "RoCE v2", 2: "RoCE v1", 3: "RoCE v2"}
    monkeypatch.setattr(verbs, "_gid_type_sysfs", lambda dev, port, i: types_[i])
    ctx = _FakeCtx(True, [V6, V6, V4, V4])
    got_ctx, choice = verbs.choose_port(_fake_pv({"down0": _FakeCtx(False, []), "rxe0": ctx}))
    assert got_ctx is ctx
    assert (choice.device, choice.gid_index) == ("rxe0", 3)
    assert choice.gid == verbs.gid_to_bytes(V4) and verbs.is_ipv4_mapped(choice.gid)
    _, chosen = verbs.choose_port(_fake_pv({"rxe0": ctx}), gid_index=1)
    assert chosen.gid_index == 1


def test_pick_gid_index() -> None:
    v4, v6, zero = verbs.gid_to_bytes(V4), verbs.gid_to_bytes(V6), bytes(16)
    assert verbs.pick_gid_index([(0, v6, "RoCE v1"), (1, v4, "RoCE v2")], True) == 1
    assert verbs.pick_gid_index([(0, v6, "RoCE v2"), (1, v4, "RoCE v1")], True) == 0
    assert verbs.pick_gid_index([(0, zero, "RoCE v2")], True) is None
    assert verbs.pick_gid_index([(0, v6, "")], False) == 0
    assert verbs.gid_to_text(v4) == V4


def test_gpu_registration_path_decision() -> None:
    def decide(**kw: bool) -> str:
        args = dict(is_gpu=True, exporter_available=True, dmabuf_mr_available=True, aligned=True)
        args.update(kw)
        return verbs.select_registration_path(**args)[0]

    assert decide() == "dmabuf"
    assert decide(is_gpu=False) == "host"
    assert decide(exporter_available=False) == "staging"
    assert decide(dmabuf_mr_available=False) == "staging"
    assert decide(aligned=False) == "staging"


def test_gpu_registration_falls_back_to_pinned_staging(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple[Any, ...]] = []

    class MR:
        def __init__(self, pd: Any, n: int, access: int, address: int = 0) -> None:
            made.append((pd, n, access, address))

        def close(self) -> None:
            pass

    class DmaBufMR:
        def __init__(self, *a: Any, **k: Any) -> None:
            raise OSError(95, "Operation not supported")

    pv = _fake_pv({})
    e = types.SimpleNamespace(
        IBV_ACCESS_LOCAL_WRITE=1, IBV_ACCESS_REMOTE_WRITE=2, IBV_ACCESS_REMOTE_READ=4
    )
    pv = verbs.Pyverbs(**{**pv.__dict__, "mr": types.SimpleNamespace(MR=MR), "enums": e})
    # no exporter at all (this machine has no CUDA): staging, with the reason
    monkeypatch.setattr(verbs, "_cuda_dmabuf_exporter", lambda: (None, "no CUDA here"))
    reg = verbs.register_device_memory("pd", 1 << 16, 1 << 20, is_gpu=True, pv=pv)
    assert reg.path == "staging" and reg.reason == "no CUDA here"
    assert reg.staging is not None and made[-1][3] == reg.staging.address
    reg.close()
    assert reg.staging.closed
    # an exporter, but the driver refuses the dma-buf: staging, with the error
    monkeypatch.setattr(verbs, "_cuda_dmabuf_exporter", lambda: (lambda p, n: os.dup(0), ""))
    pv2 = verbs.Pyverbs(**{**pv.__dict__, "mr": types.SimpleNamespace(MR=MR, DmaBufMR=DmaBufMR)})
    reg = verbs.register_device_memory("pd", 1 << 16, 1 << 20, is_gpu=True, pv=pv2)
    assert reg.path == "staging" and "dma-buf registration failed" in reg.reason
    reg.close()
    # host memory is registered in place
    reg = verbs.register_device_memory("pd", 4096, 8192, is_gpu=False, pv=pv)
    assert reg.path == "host" and made[-1][3] == 4096

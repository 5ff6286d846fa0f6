"""Installation and selection of the hot path: the normal install built the native module,
``DERECHO_ASYNC_PURE_PYTHON`` picks the twin, and both twins have the same API.

A separate test fails when the normal install did not build the extension, so a build that
silently fell back to pure Python cannot pass CI (set DERECHO_ASYNC_ALLOW_NO_NATIVE=1 to run the
suite on a machine without a C compiler).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from derecho_async import _hotpath_pure as pure
from derecho_async import hotpath
from tests.hotpath.twins import native, needs_native

# -- installation and selection ---------------------------------------------------------------


def test_the_normal_install_built_the_native_module() -> None:
    if os.environ.get("DERECHO_ASYNC_ALLOW_NO_NATIVE", "") not in ("", "0"):
        pytest.skip("DERECHO_ASYNC_ALLOW_NO_NATIVE is set")
    spec = importlib.util.find_spec("derecho_async._native")
    assert spec is not None, (
        "derecho_async._native was not built by the install (is a C compiler available?)"
    )
    assert native is not None and native.IMPLEMENTATION == "native"


def _selected(env_value: str | None) -> str:
    env = dict(os.environ)
    env.pop("DERECHO_ASYNC_PURE_PYTHON", None)
    if env_value is not None:
        env["DERECHO_ASYNC_PURE_PYTHON"] = env_value
    out = subprocess.run(
        [sys.executable, "-c", "from derecho_async import hotpath; print(hotpath.IMPLEMENTATION)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


@needs_native
def test_selection_follows_the_environment() -> None:
    assert _selected(None) == "native"
    assert _selected("0") == "native"
    assert _selected("1") == "pure"
    assert ("pure" if hotpath.REQUESTED_PURE else "native") == hotpath.IMPLEMENTATION


def test_both_twins_have_the_same_api() -> None:
    names = set(hotpath.__all__) - {"REQUESTED_PURE"}
    for name in names:
        assert hasattr(pure, name), name
        if native is not None:
            assert hasattr(native, name), name
    if native is not None:
        public = {n for n in dir(native) if not n.startswith("_")}
        assert public == names


def test_a_native_module_older_than_the_package_is_not_used() -> None:
    """An editable install whose extension was built before a function was added would fail at
    import with an AttributeError; the selector names what is missing and takes the twin."""
    import types

    assert hotpath._missing(pure) == []
    if native is not None:
        assert hotpath._missing(native) == []
    stale = types.ModuleType("stale")
    for name in hotpath.__all__:
        if name not in ("REQUESTED_PURE", "frame_log_runs"):
            setattr(stale, name, getattr(pure, name))
    assert hotpath._missing(stale) == ["frame_log_runs"]
    code = ("import sys, types, warnings; warnings.simplefilter('always'); "
            "sys.modules['derecho_async._native'] = types.ModuleType('derecho_async._native'); "
            "from derecho_async import hotpath; print(hotpath.IMPLEMENTATION)")
    env = dict(os.environ)
    env.pop("DERECHO_ASYNC_PURE_PYTHON", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "pure"
    assert "older than the package" in out.stderr and "reinstall" in out.stderr

"""A library's manners: a Group never sets a logger's level, the package logger has a
NullHandler, a missing native hot path is said once (WARNING) when a group starts, and the
version has one source (the installed metadata)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

import derecho_async as da
from derecho_async.workload import ReplicatedLog

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("level", [logging.DEBUG, logging.ERROR, logging.NOTSET])
async def test_starting_a_group_leaves_the_log_level_alone(level: int) -> None:
    logger = logging.getLogger("derecho_async")
    before = logger.level
    logger.setLevel(level)
    try:
        config = da.Config(group=f"manners-{os.getpid()}-{level}", member_id=0,
                           log_level="CRITICAL")
        async with da.Group(config, actors=[ReplicatedLog]):
            assert logger.level == level
        assert logger.level == level
    finally:
        logger.setLevel(before)


def test_the_package_logger_has_a_null_handler() -> None:
    handlers = logging.getLogger("derecho_async").handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers)


def test_a_missing_native_hot_path_is_said_once_when_a_group_starts() -> None:
    # A fresh interpreter in which the extension cannot be imported (as after an install
    # without a C compiler); the application configured logging after importing the package.
    program = textwrap.dedent("""
        import asyncio, logging, os, sys
        sys.modules["derecho_async._native"] = None  # import fails: ImportError
        import derecho_async as da
        from derecho_async import hotpath
        from derecho_async.workload import ReplicatedLog
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
        assert hotpath.IMPLEMENTATION == "pure"

        async def main() -> None:
            for i in range(2):
                cfg = da.Config(group=f"fallback-{os.getpid()}-{i}", member_id=0)
                async with da.Group(cfg, actors=[ReplicatedLog]):
                    pass

        asyncio.run(main())
    """)
    env = {k: v for k, v in os.environ.items() if k != "DERECHO_ASYNC_PURE_PYTHON"}  # (unasked)
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    said = [line for line in out.stderr.splitlines() if "_native is missing" in line]
    assert len(said) == 1 and said[0].startswith("WARNING"), out.stderr


def test_the_version_has_one_source() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert da.__version__ == metadata.version("derecho_async") == project["version"]
    text = (ROOT / "derecho_async" / "__init__.py").read_text()
    assert project["version"] not in text  # (not written twice)

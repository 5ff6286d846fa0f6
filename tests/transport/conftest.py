"""Run every async transport test on both stock asyncio and uvloop.

pytest-asyncio (>= 1.3) parametrizes async tests over the loop factories this hook returns; it is
consulted per test item, so it only affects the tests in this directory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest
import uvloop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    return {"asyncio": asyncio.SelectorEventLoop, "uvloop": uvloop.new_event_loop}

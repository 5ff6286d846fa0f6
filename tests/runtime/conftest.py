"""Runtime tests run on uvloop and on stock asyncio (pytest-asyncio loop factories)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import uvloop


def pytest_asyncio_loop_factories(
    config: object, item: object
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    return {"uvloop": uvloop.new_event_loop, "asyncio": asyncio.new_event_loop}

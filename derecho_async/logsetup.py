"""Logging for the processes this package starts itself.

A library never sets a logger's level or adds a handler that prints: the application configures
:mod:`logging` (the package logger ``derecho_async`` only has a ``NullHandler``). The member
processes that ``launch_local`` and the ``derecho-async`` command start have no application to
do that, so they call :func:`log_to_stderr` with the ``log_level`` key; the simulators run
their groups under :func:`logger_level` and put the level back after.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

__all__ = ["log_to_stderr", "logger_level"]

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_to_stderr(level: str) -> None:
    """Print this process's log records to stderr (root handler, if none is configured yet)
    and the ``derecho_async`` records from ``level`` up."""
    logging.basicConfig(format=_FORMAT)
    logging.getLogger("derecho_async").setLevel(level)


@contextlib.contextmanager
def logger_level(level: str) -> Iterator[None]:
    """The ``derecho_async`` logger at ``level`` for the block; its own level after."""
    logger = logging.getLogger("derecho_async")
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)

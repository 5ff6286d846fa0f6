"""Durable storage for subgroups: a checksummed segment log with group commit, snapshots, and
checked atomic files (docs/DESIGN.md §4.6)."""

from __future__ import annotations

from derecho_async.durability.files import (
           Fs,
           ReadFile,
           RealFs,
           WriteFile,
           atomic_write,
           read_checked,
)
from derecho_async.durability.log import Log, Recovery
from derecho_async.durability.records import LogRecord, Version
from derecho_async.durability.snapshots import Snapshots

__all__ = ["Fs", "Log", "LogRecord", "ReadFile", "RealFs", "Recovery", "Snapshots", "Version",
           "WriteFile", "atomic_write", "read_checked"]

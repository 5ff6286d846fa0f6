"""The core stays pure (DESIGN.md §3): no I/O, clock, randomness or threads may be imported."""

from __future__ import annotations

import ast
from pathlib import Path

import derecho_async.core

FORBIDDEN = {
    "asyncio",
    "socket",
    "time",
    "random",
    "os",
    "threading",
    "cupy",
    "numpy",
    "pyverbs",
    "uvloop",
    "selectors",
    "multiprocessing",
    "subprocess",
    "signal",
    "ssl",
    "datetime",
    "secrets",
    "mmap",
    "io",
    "pathlib",
    "logging",
    "msgpack",
    "concurrent",
    "torch",
}
# derecho_async.hotpath is allowed deliberately: it is pure computation over the buffers it is
# given (word loads, the slot scan, the frontier maths), the same results native or pure (see
# tests/hotpath/), with no clock, I/O or randomness. It reads one environment variable at
# import to choose its implementation, which cannot change what the core computes.
ALLOWED_PACKAGE_IMPORTS = ("derecho_async.core", "derecho_async.errors", "derecho_async.hotpath")


def _core_files() -> list[Path]:
    root = Path(derecho_async.core.__file__).parent
    files = sorted(root.rglob("*.py"))
    assert len(files) >= 8, files
    return files


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                names.append("derecho_async.core." + (node.module or ""))
            elif node.module:
                names.append(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
            names.append("<dynamic __import__>")
    return names


def test_core_imports_nothing_forbidden() -> None:
    bad = []
    for path in _core_files():
        for name in _imports(path):
            top = name.split(".")[0]
            if top in FORBIDDEN or name.startswith("<dynamic"):
                bad.append(f"{path.name}: {name}")
            elif top == "derecho_async" and not name.startswith(ALLOWED_PACKAGE_IMPORTS):
                bad.append(f"{path.name}: {name} (outside the core)")
    assert not bad, "the core must stay pure:\n" + "\n".join(bad)


def test_the_scan_catches_a_forbidden_import(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import os\nfrom time import monotonic\nfrom . import table\n")
    assert _imports(sample) == ["os", "time", "derecho_async.core."]

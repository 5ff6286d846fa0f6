"""Layering rules of the package, checked on its source (see docs/DESIGN.md §1)."""

from __future__ import annotations

import ast
import pathlib

import derecho_async

PACKAGE = pathlib.Path(derecho_async.__file__).parent
_PRIVATE_MODULES = ("_native", "_hotpath_pure")  # the native hot path and its twin (selector)


def _private_uses(path: pathlib.Path) -> list[str]:
    """``from derecho_async.x import _name`` and ``module._name`` for a module imported from
    the package, in one file."""
    tree = ast.parse(path.read_text(), str(path))
    modules: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("derecho_async"):
            for alias in node.names:
                if alias.name.startswith("_") and alias.name not in _PRIVATE_MODULES:
                    found.append(f"{path.name}:{node.lineno}: imports {node.module}.{alias.name}")
                else:
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("derecho_async"):
                    modules.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
                and node.value.id in modules and node.value.id not in _PRIVATE_MODULES):
            found.append(f"{path.name}:{node.lineno}: uses {node.value.id}.{node.attr}")
    return found


def test_no_module_of_the_package_uses_another_modules_private_names() -> None:
    found = [use for path in sorted(PACKAGE.rglob("*.py")) for use in _private_uses(path)]
    assert found == [], "\n".join(found)


def test_the_check_sees_a_private_import(tmp_path: pathlib.Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("from derecho_async.codec import _secret\n"
                      "from derecho_async.transport import shm\n"
                      "shm._hidden()\n")
    assert _private_uses(sample) == ["sample.py:1: imports derecho_async.codec._secret",
                                     "sample.py:3: uses shm._hidden"]

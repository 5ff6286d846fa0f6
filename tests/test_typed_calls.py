"""Typed calls: the sample app (tests/typed_app.py) passes mypy --strict as a user's program would
see the package, wrong usage fails it line by line, and what ``Replies`` answers.

mypy runs on a copy of the sample and on a deliberately wrong program kept here as a string (so
the project's own mypy run never sees it). pyright checks the same when it is installed.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import derecho_async as da
from derecho_async.api.actor import actor_spec

ROOT = Path(__file__).resolve().parents[1]
APP = Path(__file__).with_name("typed_app.py")

# Each line marked ``# E: code`` must get exactly that mypy error; no other line may get one.
WRONG = '''
from __future__ import annotations

import derecho_async as da
from typed_app import KV


class Other(da.Actor):
    @da.ordered
    def put(self, key: str, value: bytes) -> None: ...


async def wrong(group: da.Group, client: da.Client) -> None:
    kv = group.subgroup(KV)
    await kv[KV.put]("a", 1)  # E: arg-type
    await kv[KV.put].cast("a")  # E: call-arg
    await kv[KV.incr]("a", by="2")  # E: arg-type
    text: str = await kv[KV.get].at(1)("a")  # E: assignment
    size: str = await kv[KV.size].any()()  # E: assignment
    value: int = (await kv[KV.get].at(0).versioned("a")).value  # E: assignment
    n: str = (await kv[KV.incr]("a")).raise_on_error()[0]  # E: assignment
    ok: list[str] = (await kv[KV.put]("a", b"1")).values_ok()  # E: assignment
    kv[KV.get]("a")  # E: operator
    kv[KV.put].at(1)  # E: attr-defined
    kv[Other.put]  # E: index
    group.subgroup(Other)[KV.put]  # E: index
    group.local(KV).nothing  # E: attr-defined
    group.local(KV).data["a"] = "text"  # E: assignment
    ckv = client.subgroup(KV)
    await ckv[KV.put]("a", 1)  # E: arg-type
    ckv[KV.get]("a")  # E: operator
    count: str = await ckv[KV.size].at(0)()  # E: assignment
'''

MYPY_INI = """\
[mypy]
strict = True
python_version = 3.11
mypy_path = {root}
cache_dir = {cache}

[mypy-derecho_async.*]
# found on mypy_path, checked as an installed package is: its own errors are not reported here
follow_imports = silent
"""

_LINE = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+): (?P<kind>error|note): (?P<msg>.*?)"
                   r"(?:  \[(?P<code>[a-z-]+)\])?$")


def expected_errors(source: str) -> dict[int, str]:
    """Line -> mypy error code, from the ``# E: code`` marks of ``source``."""
    return {i: m.group(1) for i, text in enumerate(source.splitlines(), 1)
            if (m := re.search(r"# E: ([a-z-]+)$", text))}


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("typed")
    shutil.copy(APP, where / "typed_app.py")
    (where / "wrong.py").write_text(WRONG)
    return where


@pytest.fixture(scope="module")
def mypy_errors(programs: Path) -> dict[str, set[tuple[int, str]]]:
    """mypy --strict over both programs: file -> its (line, code) errors."""
    ini = programs / "mypy.ini"
    ini.write_text(MYPY_INI.format(root=ROOT, cache=programs / ".mypy_cache"))
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ini), "--no-pretty",
         "--show-error-codes", "--no-error-summary", "typed_app.py", "wrong.py"],
        cwd=programs, capture_output=True, text=True, timeout=600)
    assert run.returncode in (0, 1), run.stdout + run.stderr  # 2: mypy itself failed
    errors: dict[str, set[tuple[int, str]]] = {"typed_app.py": set(), "wrong.py": set()}
    for text in run.stdout.splitlines():
        m = _LINE.match(text)
        assert m is not None, f"unexpected mypy output: {text}\n{run.stdout}"
        if m["kind"] == "error":
            errors.setdefault(m["file"], set()).add((int(m["line"]), m["code"] or "?"))
    return errors


def test_the_sample_app_type_checks_with_the_types_it_asserts(
        mypy_errors: dict[str, set[tuple[int, str]]]) -> None:
    # every assert_type in it holds: none of its handles, replies or replicas is Any
    assert mypy_errors["typed_app.py"] == set()
    assert set(mypy_errors) == {"typed_app.py", "wrong.py"}  # nothing from the package


def test_wrong_calls_fail_to_type_check(mypy_errors: dict[str, set[tuple[int, str]]]) -> None:
    want = expected_errors(WRONG)
    assert len(want) == 17
    assert sorted(mypy_errors["wrong.py"]) == sorted(want.items())


def test_pyright_agrees(programs: Path) -> None:
    pyright = shutil.which("pyright")
    if pyright is None:
        pytest.skip("pyright is not installed")
    (programs / "pyrightconfig.json").write_text(json.dumps(
        {"extraPaths": [str(ROOT)], "pythonVersion": "3.11", "typeCheckingMode": "strict",
         "reportUnusedExpression": False, "reportUnusedCoroutine": False}))
    run = subprocess.run([pyright, "--outputjson", "typed_app.py", "wrong.py"], cwd=programs,
                         capture_output=True, text=True, timeout=600)
    report = json.loads(run.stdout)
    lines: dict[str, set[int]] = {"typed_app.py": set(), "wrong.py": set()}
    for d in report["generalDiagnostics"]:
        if d["severity"] == "error":
            lines[Path(d["file"]).name].add(d["range"]["start"]["line"] + 1)
    assert lines == {"typed_app.py": set(), "wrong.py": set(expected_errors(WRONG))}


def test_the_editable_install_is_a_path_type_checkers_read() -> None:
    # package-dir {"" = "."} makes setuptools write a static .pth path entry for `pip install
    # -e .`, not its import hook (which mypy and pyright cannot follow); py.typed ships
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"": "."}
    assert "py.typed" in setuptools["package-data"]["derecho_async"]
    assert (ROOT / "derecho_async" / "py.typed").is_file()


# -- what Replies answers --------------------------------------------------------------------
def test_raise_on_error_gives_every_result_when_no_handler_raised() -> None:
    replies = da.Replies({2: "c", 0: "a", 1: "b"}, (1, 7))
    assert replies.raise_on_error() == {0: "a", 1: "b", 2: "c"}
    assert list(replies.raise_on_error()) == [0, 1, 2]
    assert replies.values_ok() == ["a", "b", "c"]


def test_raise_on_error_raises_the_lowest_members_handler_error() -> None:
    mine = ValueError("bad input")
    replies = da.Replies({2: mine, 1: da.HandlerError(1, "ValueError", "bad input"), 0: 5},
                         (1, 7))
    with pytest.raises(da.HandlerError) as got:
        replies.raise_on_error()
    assert got.value.member == 1
    with pytest.raises(ValueError, match="bad input"):
        da.Replies({2: mine, 3: 4}, (1, 7)).raise_on_error()
    assert replies.values_ok() == [5]


def test_a_member_that_left_is_not_a_handler_error() -> None:
    replies = da.Replies({0: 1, 1: da.MemberFailed(1, "left the group before replying"), 2: 1},
                         (1, 7))
    assert replies.raise_on_error() == {0: 1, 2: 1}
    assert replies.values_ok() == [1, 1]


# -- which methods a handle takes ------------------------------------------------------------
class _Base(da.Actor):
    @da.ordered
    def put(self, key: str) -> None: ...

    @da.p2p
    def get(self, key: str) -> None: ...

    def helper(self) -> None: ...


class _Sub(_Base):
    @da.ordered
    def extra(self) -> None: ...


class _Stranger(da.Actor):
    @da.ordered
    def put(self, key: str) -> None: ...


def test_a_spec_names_its_own_and_inherited_methods_only() -> None:
    spec = actor_spec(_Sub)
    assert spec.name_of(_Sub.extra) == "extra"
    assert spec.name_of(_Base.put) == "put"
    assert spec.name_of(_Sub.get) == "get"
    for wrong in (_Stranger.put, _Base.helper, len, "put", None):
        with pytest.raises(da.UsageError, match=r"handle\[_Sub.method\]"):
            spec.name_of(wrong)
    with pytest.raises(da.UsageError):
        actor_spec(_Base).name_of(_Sub.extra)

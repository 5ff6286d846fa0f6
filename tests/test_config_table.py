"""The table of configuration keys (derecho_async.config.KEYS) and the README's copy of it."""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Any

import pytest

from derecho_async.config import ENV_PREFIX, ENV_RESERVED, KEYS, Config
from derecho_async.config.forms import Int, Number, PeerTable
from derecho_async.config.keys import REQUIRED, Key
from derecho_async.config.readme import HEADER, main, markdown_table
from derecho_async.errors import ConfigError

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BASE: dict[str, Any] = {"group": "g", "member_id": 0}


def readme_table() -> str:
    lines = README.read_text(encoding="utf-8").splitlines()
    start = lines.index(HEADER)
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join(lines[start:end]) + "\n"


def test_the_readme_holds_exactly_the_table_made_from_the_keys() -> None:
    assert readme_table() == markdown_table(), (
        "README.md's configuration table is out of date: "
        "python -m derecho_async.config.readme prints the current one"
    )


def test_every_key_its_default_and_its_doc_are_in_the_readme() -> None:
    rows = readme_table().splitlines()[2:]
    assert len(rows) == len(KEYS)
    for k, row in zip(KEYS, rows, strict=True):
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert cells == [f"`{k.name}`", k.default_text(), k.form.allowed(), k.doc]


def test_the_table_prints(capsys: pytest.CaptureFixture[str]) -> None:
    main()
    assert capsys.readouterr().out == markdown_table()


def test_one_key_per_field_with_its_default() -> None:
    assert [k.name for k in KEYS] == [f.name for f in dataclasses.fields(Config)]
    c = Config(**BASE)
    for k in KEYS:
        assert k.doc and "\n" not in k.doc and "|" not in k.doc, k.name
        if k.default is REQUIRED:
            assert k.name in BASE
        else:
            assert getattr(c, k.name) == k.default, k.name


def test_every_key_is_set_by_its_own_environment_variable() -> None:
    variables = [k.env for k in KEYS]
    assert variables == [ENV_PREFIX + k.name.upper() for k in KEYS]
    assert not set(variables) & ENV_RESERVED


def test_every_numeric_key_is_bounded() -> None:
    numeric = [k for k in KEYS if isinstance(k.form, Int | Number)]
    assert len(numeric) >= 20
    for k in numeric:
        form = k.form
        assert isinstance(form, Int | Number)
        assert math.isfinite(form.low) and math.isfinite(form.high) and form.low < form.high


def _env_text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@pytest.mark.parametrize("k", [k for k in KEYS if k.default not in (None, REQUIRED)],
                         ids=lambda k: k.name)
def test_each_default_round_trips_through_the_environment(k: Key) -> None:
    assert k.env is not None
    if isinstance(k.form, PeerTable):
        text = "0=h:1"
        want: object = {0: "h:1"}
    else:
        text = _env_text(k.default)
        want = k.default
    c = Config.from_env({"DERECHO_ASYNC_GROUP": "g", "DERECHO_ASYNC_MEMBER_ID": "0",
                         k.env: text})
    assert getattr(c, k.name) == want


@pytest.mark.parametrize(
    ("changes", "ok"),
    [
        ({"heartbeat_ms": 60_000, "suspect_after_ms": 60_001}, True),
        ({"heartbeat_ms": 60_000.5, "suspect_after_ms": 70_000}, False),
        ({"heartbeat_ms": 1, "suspect_after_ms": 1.5}, True),
        ({"heartbeat_ms": 1e-3, "suspect_after_ms": 2e-3}, False),
        ({"suspect_after_ms": 3_600_000}, True),
        ({"suspect_after_ms": 3_600_000.5}, False),
        ({"heartbeat_ms": 50, "suspect_after_ms": 50}, False),
        ({"rdma_gid_index": 255}, True),
        ({"rdma_gid_index": 256}, False),
        ({"member_id": 2**63 - 1}, True),
    ],
)
def test_the_ranges_of_the_timing_keys(changes: dict[str, object], ok: bool) -> None:
    if ok:
        c = Config(**{**BASE, **changes})
        assert all(getattr(c, name) == value for name, value in changes.items())
        return
    with pytest.raises(ConfigError) as info:
        Config(**{**BASE, **changes})
    assert info.value.key in changes


def test_suspect_after_names_the_heartbeat_it_must_exceed() -> None:
    with pytest.raises(ConfigError) as info:
        Config(**BASE, heartbeat_ms=600, suspect_after_ms=500)
    assert "greater than heartbeat_ms" in info.value.expected
    assert "heartbeat_ms = 600.0" in info.value.expected

"""Where settings come from besides arguments: a TOML file, DERECHO_ASYNC_* variables, and
Config.load's precedence over them; errors name the key and the source."""

from __future__ import annotations

from pathlib import Path

import pytest

from derecho_async.config import Config
from derecho_async.errors import ConfigError
from tests.config.support import SECRET

# ------------------------------------------------------------------------------------ TOML


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "member.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_toml_top_level(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
group = "weights"
member_id = 2
transport = "tcp"
secret = "dasec1.ye3NsVOPJOlIII0joDKBJ3G1YHx6_zN5qXb2_9WHz3E.rRGvhV"
heartbeat_ms = 10
partition_safety = false

[peers]
0 = "h1:7000"
1 = "[::1]:7000"
""",
    )
    c = Config.from_toml(path)
    assert (c.group, c.member_id, c.transport, c.partition_safety) == ("weights", 2, "tcp", False)
    assert c.heartbeat_ms == 10.0
    assert c.peers == {0: "h1:7000", 1: "[::1]:7000"}


def test_toml_table_ignores_rest_of_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[server]
port = 8080

[derecho_async]
group = "g"
member_id = 1
window = 16

[derecho_async.peers]
1 = "a:1"
""",
    )
    c = Config.from_toml(str(path), window=32)
    assert (c.group, c.member_id, c.window) == ("g", 1, 32)
    assert c.peers == {1: "a:1"}


def test_toml_values_are_not_coerced(tmp_path: Path) -> None:
    path = write(tmp_path, 'group = "g"\nmember_id = "2"\n')
    with pytest.raises(ConfigError) as info:
        Config.from_toml(path)
    assert info.value.key == "member_id"
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("body", "key"),
    [
        ('group = "g"\nmember_id = 1\nwindows = 3\n', "windows"),
        ('[derecho_async]\ngroup = "g"\nmember_id = 1\nbogus = true\n', "bogus"),
        ('group = "g"\nmember_id = 1\n[peers]\nx = "h:1"\n', "peers"),
        ('group = "g"\nmember_id = 1\npeers = ["h:1"]\n', "peers"),
        ("derecho_async = 3\n", "derecho_async"),
        ("member_id = 1\n", "group"),
        ('group = "g"\nmember_id = 1\nheartbeat_ms = 1979-05-27\n', "heartbeat_ms"),
    ],
)
def test_toml_errors(tmp_path: Path, body: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_toml(write(tmp_path, body))
    assert info.value.key == key


def test_toml_unknown_override(tmp_path: Path) -> None:
    path = write(tmp_path, 'group = "g"\nmember_id = 1\n')
    with pytest.raises(ConfigError) as info:
        Config.from_toml(path, nope=1)
    assert info.value.key == "nope"


def test_toml_malformed_and_missing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_toml(write(tmp_path, "group = \n"))
    assert info.value.key == "path"
    assert "TOML" in info.value.expected
    with pytest.raises(ConfigError) as info:
        Config.from_toml(tmp_path / "absent.toml")
    assert info.value.key == "path"
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b'group = "caf\xe9"\n')
    with pytest.raises(ConfigError) as info:
        Config.from_toml(latin1)
    assert info.value.key == "path"


# ----------------------------------------------------------------------------- environment


def test_env_parses_by_type() -> None:
    env = {
        "DERECHO_ASYNC_GROUP": "g",
        "DERECHO_ASYNC_MEMBER_ID": "2",
        "DERECHO_ASYNC_INITIAL_MEMBERS": " 3 ",
        "DERECHO_ASYNC_TRANSPORT": "tcp",
        "DERECHO_ASYNC_SECRET": SECRET,
        "DERECHO_ASYNC_PARTITION_SAFETY": "false",
        "DERECHO_ASYNC_PEERS": "0=h1:7000, 1=h2:7000,2=[::1]:9,",
        "DERECHO_ASYNC_HEARTBEAT_MS": "2.5",
        "DERECHO_ASYNC_SUSPECT_AFTER_MS": "1e2",
        "DERECHO_ASYNC_RDMA_GID_INDEX": "",
        "DERECHO_ASYNC_CONTACT": "",
        "DERECHO_ASYNC_LOG_LEVEL": "error",
        "DERECHO_ASYNC_LONG_SWEEP": "1",
        "PATH": "/usr/bin",
    }
    c = Config.from_env(env)
    assert (c.group, c.member_id, c.initial_members, c.transport) == ("g", 2, 3, "tcp")
    assert c.partition_safety is False
    assert c.peers == {0: "h1:7000", 1: "h2:7000", 2: "[::1]:9"}
    assert (c.heartbeat_ms, c.suspect_after_ms) == (2.5, 100.0)
    assert c.rdma_gid_index is None and c.contact is None
    assert c.log_level == "ERROR"


@pytest.mark.parametrize("word", ["1", "true", "TRUE", "yes", "on", " On "])
def test_env_true_words(word: str) -> None:
    env = {"DERECHO_ASYNC_GROUP": "g", "DERECHO_ASYNC_MEMBER_ID": "0"}
    c = Config.from_env({**env, "DERECHO_ASYNC_PARTITION_SAFETY": word})
    assert c.partition_safety is True
    c = Config.from_env({**env, "DERECHO_ASYNC_PARTITION_SAFETY": "0"}, partition_safety=True)
    assert c.partition_safety is True


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("DERECHO_ASYNC_MEMBER_ID", "two"),
        ("DERECHO_ASYNC_MEMBER_ID", "1.0"),
        ("DERECHO_ASYNC_MEMBER_ID", "-1"),
        ("DERECHO_ASYNC_MEMBER_ID", "1" * 5000),
        ("DERECHO_ASYNC_PEERS", "1" * 5000 + "=h:1"),
        ("DERECHO_ASYNC_WINDOW", "0"),
        ("DERECHO_ASYNC_WINDOW", ""),
        ("DERECHO_ASYNC_HEARTBEAT_MS", "fast"),
        ("DERECHO_ASYNC_HEARTBEAT_MS", "nan"),
        ("DERECHO_ASYNC_PARTITION_SAFETY", "maybe"),
        ("DERECHO_ASYNC_PEERS", "0:h:1"),
        ("DERECHO_ASYNC_PEERS", "x=h:1"),
        ("DERECHO_ASYNC_PEERS", "0=h:1,0=h:2"),
        ("DERECHO_ASYNC_PEERS", "0=h"),
        ("DERECHO_ASYNC_RDMA_GID_INDEX", "first"),
        ("DERECHO_ASYNC_GROUP", ""),
        ("DERECHO_ASYNC_LISTEN", "nowhere"),
    ],
)
def test_env_bad_value_names_key_and_variable(variable: str, value: str) -> None:
    env = {"DERECHO_ASYNC_GROUP": "g", "DERECHO_ASYNC_MEMBER_ID": "0", variable: value}
    with pytest.raises(ConfigError) as info:
        Config.from_env(env)
    assert info.value.key == variable.removeprefix("DERECHO_ASYNC_").lower()
    assert variable in str(info.value)


def test_env_unknown_variable() -> None:
    env = {"DERECHO_ASYNC_GROUP": "g", "DERECHO_ASYNC_MEMBER_ID": "0", "DERECHO_ASYNC_WINDW": "3"}
    with pytest.raises(ConfigError) as info:
        Config.from_env(env)
    assert info.value.key == "windw"
    assert "DERECHO_ASYNC_WINDW" in str(info.value)
    assert "one of: " in info.value.expected


def test_env_missing_required() -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_env({"DERECHO_ASYNC_GROUP": "g"})
    assert info.value.key == "member_id"


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DERECHO_ASYNC_GROUP", "from-env")
    monkeypatch.setenv("DERECHO_ASYNC_MEMBER_ID", "7")
    c = Config.from_env()
    assert (c.group, c.member_id) == ("from-env", 7)


def test_env_override_error_has_no_variable() -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_env({"DERECHO_ASYNC_GROUP": "g"}, member_id=-1)
    assert info.value.key == "member_id"
    assert "environment" not in str(info.value)


# ------------------------------------------------------------------------------------ load


def test_load_precedence(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[derecho_async]\ngroup = "file"\nmember_id = 1\nwindow = 8\nmax_payload = 128\n',
    )
    env = {"DERECHO_ASYNC_WINDOW": "16", "DERECHO_ASYNC_MEMBER_ID": "2"}
    c = Config.load(path, env, member_id=3)
    assert (c.group, c.member_id, c.window, c.max_payload) == ("file", 3, 16, 128)
    c = Config.load(path, {})
    assert (c.member_id, c.window) == (1, 8)


def test_load_merges_before_validating(tmp_path: Path) -> None:
    path = write(tmp_path, 'group = "g"\n')
    c = Config.load(path, {"DERECHO_ASYNC_MEMBER_ID": "4"})
    assert c.member_id == 4
    c = Config.load(environ={}, group="x", member_id=0)
    assert c.group == "x"


def test_load_error_names_the_source(tmp_path: Path) -> None:
    path = write(tmp_path, 'group = "g"\nmember_id = 1\nwindow = 0\n')
    with pytest.raises(ConfigError) as info:
        Config.load(path, {})
    assert info.value.key == "window" and str(path) in str(info.value)
    with pytest.raises(ConfigError) as info:
        Config.load(path, {"DERECHO_ASYNC_WINDOW": "70000"})
    assert "DERECHO_ASYNC_WINDOW" in str(info.value)
    assert Config.load(path, {}, window=2).window == 2


def test_load_unknown_override() -> None:
    with pytest.raises(ConfigError) as info:
        Config.load(environ={}, group="g", member_id=0, colour="blue")
    assert info.value.key == "colour"

"""``launch_local`` over tcp, and ``listen`` derived from ``peers``: a local group of member
processes forms over the network transport with nothing but ``transport="tcp"`` given."""

from __future__ import annotations

import pytest

import derecho_async as da
from derecho_async.launch import free_ports
from tests.runtime import apps

pytestmark = pytest.mark.once  # the native half of `make test` only: see pyproject.toml

SECRET = "dasec1.eT41d3G_RrSaoXL-DFPcwIBez8hW01z6y4Wqu-hXqXE.0pZe-H"


def test_listen_is_derived_from_peers_when_they_name_this_member() -> None:
    peers = {0: "127.0.0.1:7100", 1: "127.0.0.1:7101"}
    one = da.Config(group="g", member_id=1, transport="tcp", peers=peers, secret=SECRET)
    assert one.listen == "127.0.0.1:7101"
    # an explicit listen address wins (a member behind another interface)
    own = da.Config(group="g", member_id=1, transport="tcp", peers=peers, secret=SECRET,
                    listen="0.0.0.0:7101")
    assert own.listen == "0.0.0.0:7101"
    # a joiner that peers does not name listens on any free port, as before
    joiner = da.Config(group="g", member_id=5, transport="tcp", peers=peers, secret=SECRET)
    assert joiner.listen == "127.0.0.1:0"


def test_launch_local_over_tcp_forms_the_group_with_a_generated_secret() -> None:
    codes = da.launch_local(
        3, apps.append_and_check, transport="tcp", heartbeat_ms=10, suspect_after_ms=1000,
        timeout=90,
    )
    assert codes == [0, 0, 0]


def test_launch_local_over_tcp_with_given_peers_and_secret() -> None:
    ports = free_ports(2)
    peers = {i: f"127.0.0.1:{p}" for i, p in enumerate(ports)}
    codes = da.launch_local(
        2, apps.append_and_check, transport="tcp", peers=peers, secret=SECRET,
        heartbeat_ms=10, suspect_after_ms=1000, timeout=90,
    )
    assert codes == [0, 0]


def test_a_derived_listen_follows_replace() -> None:
    peers = {0: "127.0.0.1:7100", 1: "127.0.0.1:7101"}
    one = da.Config(group="g", member_id=1, transport="tcp", peers=peers, secret=SECRET)
    assert one.replace(member_id=0).listen == "127.0.0.1:7100"
    assert one.replace(member_id=7).listen == "127.0.0.1:0"
    assert one.replace(heartbeat_ms=20).listen == "127.0.0.1:7101"

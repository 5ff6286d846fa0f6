"""The transport conformance suite over SimTransport (derecho_async.testing.simnet).

Every case of test_transport_conformance.py runs unchanged over a SimNetwork without faults:
with zero delays on stock asyncio and uvloop (this directory's loop factories), and with random
delays on the VirtualTimeLoop. One case is left out on purpose:
``test_send_to_absent_member_reports_failure``: a simulated network, like a real one, cannot know
that nobody will ever take an id, so it holds what is sent to an id without an endpoint until one
starts (and drops what is sent to a crashed or closed one), never reporting a failure: detecting
dead peers is the protocol's job. The test below checks that contract instead.
"""

from __future__ import annotations

import contextlib
import inspect
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import test_transport_conformance as conformance
from transport_support import Cluster, Recorder, new_group

from derecho_async.testing.simnet import SimNetwork, SimTransport
from derecho_async.testing.vloop import run_virtual

#: conformance cases whose contract point SimNetwork deliberately does otherwise (see above)
NOT_SIM = {"test_send_to_absent_member_reports_failure"}
CASES = sorted(n for n in dir(conformance) if n.startswith("test_") and n not in NOT_SIM)


def sim_cluster_factory(max_delay_s: float, seed: int) -> Callable[..., Any]:
    @contextlib.asynccontextmanager
    async def sim_cluster(kind: str, n: int = 3, **opts: Any) -> AsyncIterator[Cluster]:
        assert kind == "sim"
        network = SimNetwork(random.Random(seed), max_delay_s=max_delay_s)
        ts = [network.transport(i) for i in range(n)]
        recs = [Recorder(me=i) for i in range(n)]
        try:
            for t, r in zip(ts, recs, strict=True):
                await t.start(r)
            yield Cluster(kind, new_group(), list(ts), recs)
        finally:
            for t in ts:
                await t.close()

    return sim_cluster


def make_sim_transport(kind: str, member: int, **opts: Any) -> SimTransport:
    assert kind == "sim"
    return SimNetwork(random.Random(0)).transport(member)


def _case(
    case: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    max_delay_s: float,
) -> Any:
    """The coroutine of conformance case ``case`` over SimTransport."""
    monkeypatch.setattr(conformance, "cluster", sim_cluster_factory(max_delay_s, seed=len(case)))
    monkeypatch.setattr(conformance, "make_transport", make_sim_transport)
    fn = getattr(conformance, case)
    params = inspect.signature(fn).parameters
    kwargs: dict[str, Any] = {"kind": "sim"}
    if "monkeypatch" in params:
        kwargs["monkeypatch"] = monkeypatch
    if "caplog" in params:
        kwargs["caplog"] = caplog
    return fn(**kwargs)


@pytest.mark.parametrize("case", CASES)
async def test_conformance_on_a_real_loop(
    case: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    await _case(case, monkeypatch, caplog, max_delay_s=0.0)


@pytest.mark.parametrize("case", CASES)
def test_conformance_on_the_virtual_loop_with_delays(
    case: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        await _case(case, monkeypatch, caplog, max_delay_s=0.003)

    run_virtual(main, max_virtual_s=600.0)


def test_absent_member_traffic_is_held_then_landed_never_reported() -> None:
    async def main() -> None:
        network = SimNetwork(random.Random(3), max_delay_s=0.001)
        a, b = network.transport(0), network.transport(1)
        ra, rb = Recorder(me=0), Recorder(me=1)
        await a.start(ra)
        await b.start(rb)
        a.send(9, b"anyone?")  # no endpoint 9 yet: held
        a.send(1, b"still fine")
        await rb.wait_for(lambda: rb.messages(0) == [b"still fine"])
        assert network.in_flight(0, 9) == 1
        late = network.transport(9)
        rl = Recorder(me=9)
        await late.start(rl)
        await rl.wait_for(lambda: rl.messages(0) == [b"anyone?"])
        await late.close()
        a.send(9, b"gone")  # closed: dropped
        assert network.in_flight(0, 9) == 0
        assert ra.failures() == [] and rb.failures() == []
        await a.close()
        await b.close()

    run_virtual(main)

"""The transport conformance suite over SimTransport (derecho_async.testing.simnet).

Every conformance case runs over a SimNetwork without faults: with zero delays on stock asyncio
and uvloop (this directory's loop factories), and with random delays on the VirtualTimeLoop. One
case is left out on purpose: ``send_to_absent_member_reports_failure``: a simulated network, like
a real one, cannot know that nobody will ever take an id, so it holds what is sent to an id
without an endpoint until one starts (and drops what is sent to a crashed or closed one), never
reporting a failure: detecting dead peers is the protocol's job. The test below checks that
contract instead.
"""

from __future__ import annotations

import random

import pytest

from derecho_async.testing.conformance import CASES, Recorder, TransportFactory, check_transport
from derecho_async.testing.simnet import SimNetwork, SimTransport
from derecho_async.testing.vloop import run_virtual

#: conformance cases whose contract point SimNetwork deliberately does otherwise (see above)
NOT_SIM = {"send_to_absent_member_reports_failure"}
SIM_CASES = [case for case in CASES if case not in NOT_SIM]


class SimFactory(TransportFactory):
    """Endpoints of one SimNetwork per group, seeded with ``seed``."""

    def __init__(self, seed: int, max_delay_s: float) -> None:
        self.seed = seed
        self.max_delay_s = max_delay_s
        self._networks: dict[str, SimNetwork] = {}

    def make(self, group: str, member: int, *, small_buffers: bool = False) -> SimTransport:
        network = self._networks.get(group)
        if network is None:
            network = SimNetwork(random.Random(self.seed), max_delay_s=self.max_delay_s)
            self._networks[group] = network
        return network.transport(member)


@pytest.mark.parametrize("case", SIM_CASES)
async def test_conformance_on_a_real_loop(case: str) -> None:
    await check_transport(SimFactory(seed=len(case), max_delay_s=0.0), only=[case])


@pytest.mark.parametrize("case", SIM_CASES)
def test_conformance_on_the_virtual_loop_with_delays(case: str) -> None:
    async def main() -> None:
        await check_transport(SimFactory(seed=len(case), max_delay_s=0.003), only=[case])

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

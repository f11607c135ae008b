"""Dispatch at the edge, scripted: several proxies' real cluster clients choose instances from their own views
(daemons/proxy/cluster/view.py) while the instances' heartbeats reach them in an order the test sets. What
tests/e2e/test_edge_dispatch.py shows with real daemons only when the machine's timing allows (a burst over four
proxies spreads instead of herding) is shown here for the orders that matter, the same way on every run: no
heartbeat during the burst, and heartbeats after every round. The tie rotation's wall-clock turn is pinned
(each proxy's ``tie_start`` is set from its rank), as a burst within one turn sees it."""

from __future__ import annotations

from collections import Counter

import pytest

from daemons import wire
from daemons.config import load_config
from daemons.proxy.cluster.client import ClusterClient
from tests.support import virtual

INSTANCES = ["i0", "i1", "i2", "i3"]
PROXIES = 4
PER_REQUEST_BLOCKS = 2


def load(received: int) -> wire.InstanceLoad:
    return wire.InstanceLoad(blocks_total=100, blocks_used=received * PER_REQUEST_BLOCKS, running=received,
                             waiting=0, batch_size=8, block_size=16, requests_received=received)


def address(iid: str) -> str:
    return f"tcp://127.0.0.1:{7000 + INSTANCES.index(iid)}"


class Fleet:
    """Four proxies (ranks 0..3) over four idle instances; every Submit a proxy sends is recorded."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, str]] = []  # (proxy rank, instance id)
        self.per_proxy: dict[int, Counter] = {}
        self.proxies = [self._proxy(rank) for rank in range(PROXIES)]

    def _proxy(self, rank: int) -> ClusterClient:
        c = ClusterClient(load_config(None, ["proxy.dispatch=local"]))
        c.known.rank, c.known.proxies = rank, PROXIES
        c.known.tie_start = lambda: rank / PROXIES  # one tie turn for the whole burst
        c.known.snapshot = [wire.InstanceView(iid, "h", 1, "alive", address(iid), "sim", "m", load(0), 1.0, 0.0)
                      for iid in INSTANCES]
        c.known.addresses = {iid: address(iid) for iid in INSTANCES}
        by_address = {address(iid): iid for iid in INSTANCES}
        self.per_proxy[rank] = Counter()

        def send(addr: str, msg: wire.Message) -> bool:
            if isinstance(msg, wire.Submit):
                self.sent.append((rank, by_address[addr]))
                self.per_proxy[rank][by_address[addr]] += 1
            return True

        c.port.send = send
        return c

    async def submit(self, rank: int, n: int) -> None:
        c = self.proxies[rank]
        rid = f"p{rank}-{len(self.sent)}"
        await c.submit(wire.Submit(rid, list(range(20)), wire.SamplingParams(max_tokens=n), "tcp://proxy:5"))

    def heartbeats(self) -> None:
        """Every instance tells every proxy its load now (all it received) and how many of that proxy's it took."""
        received = Counter(iid for _, iid in self.sent)
        for rank, c in enumerate(self.proxies):
            for iid in INSTANCES:
                c.on_instance_message(wire.Heartbeat(iid, address(iid), True, load(received[iid]), True,
                                                     self.per_proxy[rank][iid]))

    def close(self) -> None:
        for c in self.proxies:
            c.sec.close()
            c.ctx.destroy(linger=0)


def run(script) -> Fleet:
    async def main(loop):
        fleet = Fleet()
        try:
            await script(fleet)
        finally:
            fleet.close()
        return fleet
    return virtual.run(main)


def test_one_request_per_proxy_over_idle_instances_lands_one_per_instance():
    async def script(f: Fleet):
        for rank in range(PROXIES):  # each sees the same idle view and none sees the others' dispatches
            await f.submit(rank, 10)

    f = run(script)
    assert Counter(iid for _, iid in f.sent) == {iid: 1 for iid in INSTANCES}, f.sent


@pytest.mark.parametrize("beats", ["none during the burst", "after every round"])
def test_a_burst_of_four_per_proxy_spreads_evenly(beats):
    async def script(f: Fleet):
        for _ in range(4):
            for rank in range(PROXIES):
                await f.submit(rank, 10)
            if beats == "after every round":
                f.heartbeats()

    f = run(script)
    assert Counter(iid for _, iid in f.sent) == {iid: 4 for iid in INSTANCES}, f.sent
    # Without heartbeats a proxy only knows its own dispatches: it spreads them over every instance.
    if beats == "none during the burst":
        assert all(set(per) == set(INSTANCES) for per in f.per_proxy.values()), f.per_proxy

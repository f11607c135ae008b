"""The migrator's parts on their own (daemons/migration/): the source role routes a destination's answers to
the move they belong to and ends its waits when the connection drops; a stage's plan says when it waits for
MigReady; the peers forget only what no migration holds. No sockets, no engine: plain objects and a loop."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from daemons import stages, wire
from daemons.clock import Clock
from daemons.migration.move import Stage
from daemons.migration.peers import PEER_IDLE_S, Peers
from daemons.migration.records import DestinationFailed, Outgoing, Refused
from daemons.migration.side import Parts
from daemons.migration.source import Source


class ManualClock(Clock):
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


def source(timeout_s: float = 5.0) -> Source:
    cfg = SimpleNamespace(timeout_s=timeout_s)
    host = SimpleNamespace(wake=asyncio.Event())
    return Source(Parts(host, cfg, engine=None, requests=None, boundary=None, kv=None, peers=None, clock=Clock()))


def test_answers_reach_their_move_and_a_refusal_or_a_drop_ends_the_wait():
    async def main():
        src = source()
        a, b = Outgoing("a", "tcp://d1", dst="d1"), Outgoing("b", "tcp://d2", dst="d2")
        src.opened(a)
        src.opened(b)
        assert src.addresses() == {"tcp://d1", "tcp://d2"} and src.pair_names() == {"d1", "d2"}
        src.deliver(wire.MigReady("a", 0))
        src.deliver(wire.MigReady("nobody", 0))  # a move that ended meanwhile: dropped
        assert (await src.reply(a, wire.MigReady, 0, "the reservation")).mig_id == "a"
        src.deliver(wire.MigDone("b", 1, False, "no room"))
        with pytest.raises(Refused, match="no room"):
            await src.reply(b, wire.MigDone, 1, "stage 1's copy")
        src.peer_gone("tcp://d1")
        with pytest.raises(DestinationFailed, match="dropped"):
            await src.reply(a, wire.MigDone, 0, "stage 0's copy")
        src.closed(a)
        src.ended(committed=False)
        assert set(src.outgoing) == {"b"} and src.aborted == 1 and src.committed == 0

    asyncio.run(main())


def test_a_reply_that_never_comes_times_out_as_the_destination_failing():
    async def main():
        src = source(timeout_s=0.01)
        out = Outgoing("a", "tcp://d1", dst="d1")
        src.opened(out)
        with pytest.raises(DestinationFailed, match="did not answer"):
            await src.reply(out, wire.MigReady, 0, "the reservation")

    asyncio.run(main())


def test_only_the_first_stage_and_pre_copy_stages_wait_for_mig_ready():
    plan = stages.plan(100, 0, False, 16, 2)
    last = stages.plan(100, 6, True, 16, 2)
    assert Stage(0, plan, []).await_ready and Stage(0, plan, []).kind == "reserve"
    assert Stage(3, plan, []).await_ready and Stage(3, plan, []).kind == "pre-copy"
    assert Stage(0, last, []).await_ready  # blocking migration: the last stage is also the reservation
    assert not Stage(4, last, []).await_ready and Stage(4, last, []).kind == "last"


def test_peers_forget_idle_pairs_but_not_those_a_migration_holds():
    forgotten: list[str] = []
    kv = SimpleNamespace(forget=forgotten.append)
    clock = ManualClock()
    held = {"busy-pair"}
    peers = Peers(dealer=None, kv=kv, clock=clock, spawn=None, in_use=lambda: (set(), held),
                  on_reply=None, on_gone=None)
    peers.pair_used("idle-pair")
    peers.pair_used("busy-pair")
    clock.now = PEER_IDLE_S / 2
    peers.prune()
    assert forgotten == []
    clock.now = PEER_IDLE_S + 1
    peers.prune()
    assert forgotten == ["idle-pair"] and set(peers.pairs_used) == {"busy-pair"}

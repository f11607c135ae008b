"""The proxy's ownership protocol under every arrival order (Hypothesis): a request placed on one instance
migrates one to three times; the last move may race (the source never hears the commit acknowledgement and
resumes under the epoch the destination claims: two copies, different samples). The messages of each
instance reach the proxy in the order it sent them (one connection each), but the instances' messages
interleave in any order. Whatever the order, the client gets every index exactly once and in order, the
tokens after the last move all come from one copy, and only the copy that lost is aborted (by its epoch).

The real ClusterClient takes the messages (its token-path handler); only its sends to instances are recorded
instead of sent."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from daemons import wire
from daemons.config import load_config
from daemons.proxy.cluster import ClusterClient, Stream

IDS = ["i0", "i1", "i2"]
RID = "req-1"


def address(iid: str) -> str:
    return f"tcp://127.0.0.1:{7000 + IDS.index(iid)}"


def legit(i: int) -> int:
    return 1000 + i


def resumed(i: int) -> int:  # what a source that resumed after an unacknowledged commit samples instead
    return 2000 + i


def tokens(iid: str, lo: int, hi: int, epoch: int, n: int, content=legit) -> list[tuple[str, wire.Message]]:
    outs = [wire.TokenOut(RID, i, content(i), "length" if i == n - 1 else None, epoch=epoch) for i in range(lo, hi)]
    return [(iid, wire.TokenBatch(iid, [o])) for o in outs]


@st.composite
def histories(draw):
    """(messages by sender in send order, the cut where the last move happened, whether it raced)."""
    hops = draw(st.integers(1, 3))
    owners = [draw(st.sampled_from(IDS))]
    for _ in range(hops):
        owners.append(draw(st.sampled_from([i for i in IDS if i != owners[-1]])))
    cuts = sorted(draw(st.lists(st.integers(1, 10), min_size=hops, max_size=hops, unique=True)))
    n = cuts[-1] + draw(st.integers(1, 5))
    race = draw(st.booleans())
    bounds = [0, *cuts, n]
    sent: list[tuple[str, wire.Message]] = []  # in the order things happened (each sender's order is kept)
    sent += tokens(owners[0], 0, bounds[1], 1, n)
    for h in range(hops):
        src, dst, epoch, cut = owners[h], owners[h + 1], h + 2, bounds[h + 1]
        last = h == hops - 1
        claim = wire.Moved(RID, dst, address(dst), epoch, cut)
        sent.append((dst, claim))  # the destination commits and claims the request
        if last and race:
            # The source's wait for the acknowledgement timed out: it resumes under the same epoch.
            sent.append((src, wire.Moved(RID, src, address(src), epoch, cut)))
            sent += tokens(src, cut, n, epoch, n, content=resumed)
        else:
            sent.append((src, claim))  # the source heard the commit: it tells the proxy too
        sent += tokens(dst, cut, bounds[h + 2], epoch, n)
    by_sender: dict[str, list[wire.Message]] = {}
    for who, msg in sent:
        by_sender.setdefault(who, []).append(msg)
    order = draw(st.permutations([who for who, _ in sent]))
    return by_sender, order, n, cuts[-1], race, owners


@settings(max_examples=400, deadline=None)
@given(histories())
def test_every_index_once_in_order_from_one_copy_whatever_the_arrival_order(history):
    by_sender, order, n, cut, race, owners = history
    client = ClusterClient(load_config(None, []))
    client.token_address = "inproc://ownership-proxy"  # what start() would have bound (it is not started)
    aborts: list[tuple[str, wire.Message]] = []
    client.port.send = lambda addr, msg: aborts.append((addr, msg)) if isinstance(msg, wire.Abort) else True
    try:
        stream = Stream(RID, wire.Submit(RID, [1, 2, 3], wire.SamplingParams(), "tcp://proxy:5"))
        stream.instance_id, stream.address, stream.epoch = owners[0], address(owners[0]), 1  # as a dispatch does
        client.streams[RID] = stream
        client.known.addresses = {iid: address(iid) for iid in IDS}
        queues = {who: list(msgs) for who, msgs in by_sender.items()}
        winner_claim = None
        heard: list[tuple[str, wire.Message]] = []
        for who in order:
            msg = queues[who].pop(0)
            if race and isinstance(msg, wire.Moved) and msg.epoch == len(owners) and winner_claim is None:
                winner_claim = msg.instance_id  # the first claim heard for the racing epoch
            client.on_instance_message(msg)
            heard.append((who, msg))
            if stream.done and RID in client.streams:
                client.finish(stream)  # as the request's handler does once the client has the last token
        got = [o for o in stream.ready]
        assert [o.index for o in got] == list(range(n)), [o.index for o in got]  # each once, in order
        assert stream.done
        assert [o.token_id for o in got[:cut]] == [legit(i) for i in range(cut)]
        tail = [o.token_id for o in got[cut:]]
        epoch = len(owners)  # of the last placement
        fenced = {(a, m.epoch) for a, m in aborts}
        # Every abort names a placement's epoch (an abort without one would stop whichever copy is there). A
        # claim heard after a newer one is fenced too: harmless where that copy has moved on (an instance
        # ignores an abort for an epoch it does not hold), and it stops the copy if it has not.
        assert all(m.epoch > 0 for _, m in aborts), aborts
        if not race:
            assert tail == [legit(i) for i in range(cut, n)]
            assert (address(owners[-1]), epoch) not in fenced, aborts  # the copy that serves is never aborted
        else:
            src, dst = owners[-2], owners[-1]
            won_by_source = winner_claim == src
            assert tail == [(resumed if won_by_source else legit)(i) for i in range(cut, n)]  # one copy, not a mix
            winner, loser = (src, dst) if won_by_source else (dst, src)
            # The copy that lost is stopped once the proxy hears it run (a claim alone may come too late: the
            # stream may have ended and been forgotten; then its next token is an orphan's, and aborted) ...
            ran = any(who == loser and isinstance(m, wire.TokenBatch) and m.outputs[0].epoch == epoch
                      and m.outputs[0].finish_reason is None for who, m in heard)
            assert (address(loser), epoch) in fenced or not ran, aborts
            assert (address(winner), epoch) not in fenced, aborts  # ... and the copy that won never is
    finally:
        client.sec.close()
        client.ctx.destroy(linger=0)


def test_a_redispatch_that_fails_unexpectedly_fails_the_stream_at_once():
    """Not only "no instance": whatever breaks a redispatch reaches the client now, not at its deadline."""
    client = ClusterClient(load_config(None, []))

    async def broken(stream):
        raise RuntimeError("the view is broken")

    client.failover.dispatch = broken
    stream = Stream(RID, wire.Submit(RID, [1, 2, 3], wire.SamplingParams(), "tcp://proxy:5"))
    try:
        asyncio.run(client.failover.redispatch(stream, "instance i0 gave it back"))
    finally:
        client.ctx.destroy(linger=0)
    assert stream.done and stream.status == 503
    assert stream.error == "instance i0 gave it back; dispatching it again failed: RuntimeError: the view is broken"

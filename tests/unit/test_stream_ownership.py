"""The proxy's ownership protocol under every arrival order (Hypothesis): a request placed on one instance
may fail over first (its instance stalls; the proxy places it elsewhere by re-prefill under a new epoch, while
the stalled copy's late tokens still arrive), then migrates one to three times; the last move may race (the
source never hears the commit acknowledgement and resumes under the epoch the destination claims: two copies,
different samples). The messages of each instance reach the proxy in the order it sent them (one connection
each), but the instances' messages, and the proxy's own failover, interleave in any order. Whatever the
order, the client gets every index exactly once and in order, each index from the copy that owned it (the
stalled copy's tokens only before the failover's cut; the tokens after the last move all from one copy), and
only the copy that lost is aborted (by its epoch).

The real ClusterClient takes the messages (its token-path handler); only its sends to instances are recorded
instead of sent, and the failover's placement is made as a dispatch makes it."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemons import wire
from daemons.config import load_config
from daemons.proxy.cluster.client import ClusterClient, Stream

IDS = ["i0", "i1", "i2"]
RID = "req-1"
PROXY = "proxy"  # the pseudo-sender of the failover event


def address(iid: str) -> str:
    return f"tcp://127.0.0.1:{7000 + IDS.index(iid)}"


def legit(i: int) -> int:  # what the first placement samples (and the copies it migrates to)
    return 1000 + i


def resumed(i: int) -> int:  # what a source that resumed after an unacknowledged commit samples instead
    return 2000 + i


def redone(i: int) -> int:  # what the placement after a failover samples (it re-prefills, then samples anew)
    return 3000 + i


def tokens(iid: str, lo: int, hi: int, epoch: int, n: int | None, content) -> list[tuple[str, wire.Message]]:
    """``n``: the request's length (its last index finishes it); None: a copy that never finishes."""
    outs = [wire.TokenOut(RID, i, content(i), "length" if i == (n or 0) - 1 else None, epoch=epoch)
            for i in range(lo, hi)]
    return [(iid, wire.TokenBatch(iid, [o])) for o in outs]


@st.composite
def plans(draw):
    """What happens, in each sender's own order; the interleaving is drawn as the test runs."""
    failover = draw(st.booleans())
    hops = draw(st.integers(1, 3))
    first = draw(st.sampled_from(IDS))
    owners = [draw(st.sampled_from([i for i in IDS if i != first]))] if failover else [first]
    for _ in range(hops):
        owners.append(draw(st.sampled_from([i for i in IDS if i != owners[-1]])))
    offsets = sorted(draw(st.lists(st.integers(1, 10), min_size=hops, max_size=hops, unique=True)))
    return {"failover": failover, "first": first, "stalled_sent": draw(st.integers(1, 6)), "owners": owners,
            "offsets": offsets, "tail": draw(st.integers(1, 5)), "race": draw(st.booleans())}


def migrations(plan: dict, base: int, epoch0: int, content) -> tuple[list[tuple[str, wire.Message]], int, int]:
    """The messages of the placement at ``base`` (epoch ``epoch0``) and of its moves; (messages, n, last cut)."""
    owners, race = plan["owners"], plan["race"]
    cuts = [base + o for o in plan["offsets"]]
    n = cuts[-1] + plan["tail"]
    bounds = [base, *cuts, n]
    sent = tokens(owners[0], base, bounds[1], epoch0, n, content)
    hops = len(owners) - 1
    for h in range(hops):
        src, dst, epoch, cut = owners[h], owners[h + 1], epoch0 + h + 1, bounds[h + 1]
        claim = wire.Moved(RID, dst, address(dst), epoch, cut)
        sent.append((dst, claim))  # the destination commits and claims the request
        if h == hops - 1 and race:
            # The source's wait for the acknowledgement timed out: it resumes under the same epoch.
            sent.append((src, wire.Moved(RID, src, address(src), epoch, cut)))
            sent += tokens(src, cut, n, epoch, n, resumed)
        else:
            sent.append((src, claim))  # the source heard the commit: it tells the proxy too
        sent += tokens(dst, cut, bounds[h + 2], epoch, n, content)
    return sent, n, cuts[-1]


def fail_over(stream: Stream, to: str) -> None:
    """The placement a failover makes (daemons/proxy/cluster/dispatch.py): a new epoch, owned from the next index."""
    stream.place(to, address(to), stream.epoch + 1, stream.next_index)
    stream.tried.append(to)
    stream.early.clear()  # a gap's tokens came from the copy we left: the new one sends them again


@settings(max_examples=400, deadline=None)
@given(plans(), st.data())
def test_every_index_once_in_order_from_its_owner_whatever_the_arrival_order(plan, data):
    owners, race = plan["owners"], plan["race"]
    client = ClusterClient(load_config(None, []))
    client.token_address = "inproc://ownership-proxy"  # what start() would have bound (it is not started)
    aborts: list[tuple[str, wire.Message]] = []
    client.port.send = lambda addr, msg: aborts.append((addr, msg)) if isinstance(msg, wire.Abort) else True
    try:
        stream = Stream(RID, wire.Submit(RID, [1, 2, 3], wire.SamplingParams(), "tcp://proxy:5"))
        client.streams[RID] = stream
        client.known.addresses = {iid: address(iid) for iid in IDS}
        queues: dict[str, list[wire.Message]] = {}

        def post(sent: list[tuple[str, wire.Message]]) -> None:
            for who, msg in sent:
                queues.setdefault(who, []).append(msg)

        if plan["failover"]:
            # Placed on ``first``, which stalls: its tokens (it never finishes) still arrive after the failover.
            stream.place(plan["first"], address(plan["first"]), 1, 0)
            post(tokens(plan["first"], 0, plan["stalled_sent"], 1, None, legit))
            queues[PROXY] = ["fail over"]
            n = last_cut = split = None  # known once the failover has happened
        else:
            stream.place(owners[0], address(owners[0]), 1, 0)  # as a dispatch does
            sent, n, last_cut = migrations(plan, 0, 1, legit)
            post(sent)
            split = 0
        last_epoch = stream.epoch + len(owners) - 1 + (1 if plan["failover"] else 0)
        winner_claim = None
        heard: list[tuple[str, wire.Message]] = []
        while any(queues.values()):
            who = data.draw(st.sampled_from(sorted(k for k, q in queues.items() if q)))
            msg = queues[who].pop(0)
            if who == PROXY:
                del queues[PROXY]
                split = stream.next_index  # the stalled copy's tokens reach the client before this index only
                fail_over(stream, owners[0])
                sent, n, last_cut = migrations(plan, split, stream.epoch, redone)
                post(sent)
                continue
            if race and isinstance(msg, wire.Moved) and msg.epoch == last_epoch and winner_claim is None:
                winner_claim = msg.instance_id  # the first claim heard for the racing epoch
            client.on_instance_message(msg)
            heard.append((who, msg))
            if stream.done and RID in client.streams:
                client.finish(stream)  # as the request's handler does once the client has the last token
        got = [o for o in stream.ready]
        assert [o.index for o in got] == list(range(n)), [o.index for o in got]  # each once, in order
        assert stream.done
        after = redone if plan["failover"] else legit
        assert [o.token_id for o in got[:last_cut]] == [legit(i) for i in range(split)] + \
            [after(i) for i in range(split, last_cut)]  # the stalled copy's only before the failover's cut
        tail = [o.token_id for o in got[last_cut:]]
        fenced = {(a, m.epoch) for a, m in aborts}
        # Every abort names a placement's epoch (an abort without one would stop whichever copy is there). A
        # claim heard after a newer one is fenced too: harmless where that copy has moved on (an instance
        # ignores an abort for an epoch it does not hold), and it stops the copy if it has not.
        assert all(m.epoch > 0 for _, m in aborts), aborts
        if not race:
            assert tail == [after(i) for i in range(last_cut, n)]
            assert (address(owners[-1]), last_epoch) not in fenced, aborts  # the copy that serves is never aborted
        else:
            src, dst = owners[-2], owners[-1]
            won_by_source = winner_claim == src
            assert tail == [(resumed if won_by_source else after)(i) for i in range(last_cut, n)]  # one copy
            winner, loser = (src, dst) if won_by_source else (dst, src)
            # The copy that lost is stopped once the proxy hears it run (a claim alone may come too late: the
            # stream may have ended and been forgotten; then its next token is an orphan's, and aborted) ...
            ran = any(who == loser and isinstance(m, wire.TokenBatch) and m.outputs[0].epoch == last_epoch
                      and m.outputs[0].finish_reason is None for who, m in heard)
            assert (address(loser), last_epoch) in fenced or not ran, aborts
            assert (address(winner), last_epoch) not in fenced, aborts  # ... and the copy that won never is
    finally:
        client.sec.close()
        client.ctx.destroy(linger=0)


def test_a_stalled_copys_token_after_a_later_move_is_not_taken():
    """Placed on i1, which stalls; the proxy fails over to i2 at index 0 (epoch 2), i2 moves to i0 at index 1
    (epoch 3). The stalled i1's token 0 (epoch 1) is heard after i0's claim and before i2's token 0: the client
    must get i2's token 0 (the placement i0 continues from), not the stalled copy's."""
    client = ClusterClient(load_config(None, []))
    client.token_address = "inproc://ownership-proxy"
    client.port.send = lambda addr, msg: True
    try:
        stream = Stream(RID, wire.Submit(RID, [1, 2, 3], wire.SamplingParams(), "tcp://proxy:5"))
        stream.place("i1", address("i1"), 1, 0)
        client.streams[RID] = stream
        client.known.addresses = {iid: address(iid) for iid in IDS}
        fail_over(stream, "i2")
        for msg in (wire.Moved(RID, "i0", address("i0"), 3, 1),
                    wire.TokenBatch("i1", [wire.TokenOut(RID, 0, legit(0), None, epoch=1)]),
                    wire.TokenBatch("i2", [wire.TokenOut(RID, 0, redone(0), None, epoch=2)]),
                    wire.TokenBatch("i0", [wire.TokenOut(RID, 1, redone(1), "length", epoch=3)])):
            client.on_instance_message(msg)
        assert [o.token_id for o in stream.ready] == [redone(0), redone(1)]
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

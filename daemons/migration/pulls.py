"""Prefix pulls: a request placed here whose prompt's leading blocks another instance holds (in its engine's cache
or its host tier) has them copied from there while it waits, over the migration's KV transport, instead of
prefilling them (issue: sessions; the proxy decides, wire.Submit ``pull_from``/``pull_blocks``).

    asker (here)                                     holder
    Submit(pull_from, pull_blocks) held back
    PullAsk(id, block hashes, our KV layout)  ->
                                                     export the leading blocks it holds (between steps), into a
                                                     buffer of its own; PullOffer(id, n, bytes, pair), then send
                                              <-     the buffer over the pair
    receive into a buffer of our own; import the blocks into our host tier (between steps); the Submit goes
    to the inbox, and the engine restores them from the tier as it would any tier hit

Both ends copy through buffers of their own, never engine blocks: a transfer that ends late (a timeout here,
the holder gone) writes only into memory nobody else uses, so nothing needs to be reserved or released on
either side. Any failure (no answer in time, nothing held, a layout that differs, the transfer breaking, the
holder declared dead) only means the request is queued as it came: it prefills what it lacks, and loses
nothing. Pulls use KV pairs of their own (``#pull`` peers), apart from the migrations' pairs, because their
control messages travel on other connections and a pair's sends and receives must be posted in one order.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Callable

import msgspec
import torch

from daemons import prefix, wire
from daemons.kv.layout import KvBlocks
from daemons.migration.side import Parts
from daemons.migration.transport import TransferError
from daemons.migration.telemetry import M_PULL_BYTES, M_PULL_SECONDS, M_PULLS

log = logging.getLogger("llumnix.migration")

PULL_TIMEOUT_S = 2.0  # a pull's bound, start to blocks in the tier (kv_tier.pull_timeout_s's default)
PULL_PEER = "#pull"
GIVEN_UP_KEPT = 256  # pulls given up before their offer came, remembered (where their holder is)  # the suffix of the peer name a holder's pull pair is made under


def flat_blocks(buf: torch.Tensor, blocks: int) -> KvBlocks:
    """A pull's buffer as blocks (one run of ``blocks`` blocks of opaque bytes): what the pair sends or fills."""
    return KvBlocks([buf.view(blocks, -1)], "pull")


class Pulls:
    """Owns the pulls in flight: as asker (by pull id: the future its offer completes) and as holder (counts)."""

    def __init__(self, parts: Parts, spawn: Callable, timeout_s: float = PULL_TIMEOUT_S):
        """``timeout_s``: how long a pull may take in all before its request goes on without it."""
        self.host, self.engine, self.boundary, self.kv = parts.host, parts.engine, parts.boundary, parts.kv
        self.peers, self.cfg = parts.peers, parts.cfg
        self.spawn, self.timeout_s = spawn, timeout_s
        self._ids = itertools.count(1)
        self._offers: dict[int, asyncio.Future] = {}  # pull id -> its offer (or None: the holder is dead)
        self._asked: dict[int, str] = {}  # pull id -> the holder's address
        self._given_up: dict[int, str] = {}  # the same, of the latest pulls ended before their offer came
        self.held: dict[str, wire.Submit] = {}  # request id -> its Submit, while its pull runs
        self.serving = 0  # pulls this instance is sending

    # ---------------------------------------------------------------- asker

    def start(self, submit: wire.Submit, post: Callable[[wire.Submit], None]) -> None:
        """Hold ``submit`` back while its prompt's leading blocks come from ``submit.pull_from``; then (however
        the pull ended) ``post`` it, without its pull, as if it had just come."""
        if submit.pull_from == self.host.instance_id:  # (a stale view placed it on its own holder)
            post(msgspec.structs.replace(submit, pull_from="", pull_blocks=0, pull_address=""))
            return
        self.held[submit.request_id] = submit
        self.spawn(self._pull(submit, post))

    def drop(self, request_id: str) -> bool:
        """The request was aborted while it waited for its pull: it never goes to the engine."""
        return self.held.pop(request_id, None) is not None

    async def _pull(self, submit: wire.Submit, post: Callable[[wire.Submit], None]) -> None:
        began = time.perf_counter()
        outcome, got = "failed", 0
        try:
            # The timeout bounds the wait for the holder's blocks, not their import once here (a step boundary
            # away): blocks that arrived in time are used, and counted as pulled.
            received = await asyncio.wait_for(self._fetch(submit), self.timeout_s)
            outcome, got = await self._import(*received)
        except asyncio.TimeoutError:
            outcome = "timeout"
        except Exception as exc:  # a transfer or an engine call failed: recompute
            log.info("prefix pull for %s from %s failed: %s", submit.request_id, submit.pull_from, exc)
        finally:
            M_PULLS.labels(outcome).inc()
            if got:
                M_PULL_BYTES.inc(got)
                M_PULL_SECONDS.observe(time.perf_counter() - began)
            held = self.held.pop(submit.request_id, None)
            if held is not None:  # not aborted meanwhile
                post(msgspec.structs.replace(held, pull_from="", pull_blocks=0, pull_address=""))

    def _hashes(self, submit: wire.Submit) -> list[bytes]:
        return prefix.block_hashes(submit.prompt_token_ids, self.engine.block_size,
                                   extra_keys=prefix.adapter_keys(submit.adapter, submit.adapter_path),
                                   limit=submit.pull_blocks)

    async def _fetch(self, submit: wire.Submit):
        """(outcome, bytes received, blocks asked, buffer): ``receive``'s."""
        hashes = self._hashes(submit)
        have = (await self.boundary(lambda: self.engine.prefix_hits([submit.prompt_token_ids])))[0]
        return await self.receive(submit.pull_address, hashes[have:])

    async def fetch(self, address: str, ask: list[bytes], session: str = "") -> tuple[str, int]:
        """The leading blocks of ``ask`` that the instance at ``address`` holds, into our host tier: (outcome, bytes
        received). ``session``: a re-homed session's blocks (the holder stops retaining them once sent).
        Unbounded: the caller bounds it."""
        return await self._import(*await self.receive(address, ask, session))

    async def _import(self, outcome: str, got: int, ask: list[bytes], buf) -> tuple[str, int]:
        """Blocks ``receive`` brought (``ask``: their hashes, ``buf``: their bytes) into our host tier."""
        if outcome == "pulled":
            await self.boundary(lambda: self.engine.import_blocks(ask, buf))
        return outcome, got

    async def receive(self, address: str, ask: list[bytes], session: str = ""):
        """The leading blocks of ``ask`` that the instance at ``address`` holds, received: (outcome, bytes, the
        hashes of the blocks received, their buffer). Unbounded: the caller bounds it."""
        if not ask or not address:
            return "held", 0, [], None
        pid = next(self._ids)
        offer = self._offers[pid] = asyncio.get_running_loop().create_future()
        self._asked[pid] = address
        try:
            spec = self.engine.kv_blocks().spec
            if not self.peers.send(address, wire.PullAsk(pid, self.host.instance_id, ask, spec, session)):
                return "unreachable", 0, [], None
            msg, receiving, buf = await offer
        finally:
            self._offers.pop(pid, None)
            address = self._asked.pop(pid, None)
            if not offer.done() and address:  # its offer may still come: its bytes must still be received
                self._given_up[pid] = address
                while len(self._given_up) > GIVEN_UP_KEPT:
                    del self._given_up[next(iter(self._given_up))]
        if msg is None:
            return "holder_dead", 0, [], None
        if not msg.blocks:
            return "none_held", 0, [], None
        try:
            # Shielded: a receive still queued on the pair's thread must run even when we give up on it (a
            # timeout), or the holder's send would meet the next pull's receive on that pair.
            got = await asyncio.shield(asyncio.wrap_future(receiving))
        except TransferError:  # the pair broke: its next use makes a new one
            self.kv.forget(msg.pair_key)
            raise
        return "pulled", got, ask[:msg.blocks], buf

    def on_offer(self, msg: wire.PullOffer) -> None:
        """(Event loop, from the holder's socket) Post the receive at once: the holder has posted its send, and
        the pair's operations must be posted in the order the offers come."""
        waiting = self._offers.get(msg.pull_id)
        wanted = waiting is not None and not waiting.done()
        if not msg.blocks or msg.nbytes <= 0 or msg.nbytes % msg.blocks:  # (a holder sends no such offer's bytes)
            if wanted:
                waiting.set_result((msgspec.structs.replace(msg, blocks=0), None, None))
            return
        # The holder has posted its send: whether or not we still want the blocks (a pull that timed out, a holder
        # taken for dead), the receive is posted, in the order of the offers, so that every later send on this
        # pair meets its own receive. (A receive of the wrong size aborts the process: Gloo's check.)
        address = self._asked.get(msg.pull_id) or self._given_up.pop(msg.pull_id, "")
        pair = self.kv.dest_pair(msg.pair_key, msg.store_address)
        self.peers.pair_used(msg.pair_key)
        self.peers.relay_rendezvous(pair, lambda m: self.peers.send(address, m))
        buf = torch.empty(msg.nbytes, dtype=torch.uint8)
        receiving = pair.recv(flat_blocks(buf, msg.blocks), list(range(msg.blocks)), self._chunk(msg.nbytes // msg.blocks))
        if wanted:
            waiting.set_result((msg, receiving, buf))
        else:  # its bytes are received and dropped
            receiving.add_done_callback(lambda done: done.exception())

    def peer_dead(self, address: str) -> None:
        """The holder at ``address`` is dead: its pulls end now (the requests go on without them)."""
        for pid, asked in list(self._asked.items()):
            waiting = self._offers.get(pid)
            if asked == address and waiting is not None and not waiting.done():
                waiting.set_result((None, None, None))

    def _chunk(self, block_nbytes: int) -> int:
        return max(1, self.cfg.chunk_bytes // max(block_nbytes, 1))

    # ---------------------------------------------------------------- holder

    def on_ask(self, identity: bytes, msg: wire.PullAsk) -> None:
        self.spawn(self._serve(identity, msg))

    async def _serve(self, identity: bytes, msg: wire.PullAsk) -> None:
        reply = self.host.reply_peer
        spec = self.engine.kv_blocks().spec
        if msg.kv_spec != spec:
            reply(identity, wire.PullOffer(msg.pull_id, reason="KV layout differs"))
            return
        try:
            n, buf = await self.boundary(lambda: self.engine.export_blocks(msg.hashes))
        except Exception as exc:  # an engine that cannot export: the asker recomputes
            log.info("prefix pull %d for %s: export failed: %s", msg.pull_id, msg.instance_id, exc)
            n, buf = 0, None
        if not n:
            reply(identity, wire.PullOffer(msg.pull_id, reason="none of those blocks is held here"))
            return
        buf = buf.reshape(-1).view(torch.uint8)
        pair = self.kv.source_pair(self.host.instance_id, msg.instance_id + PULL_PEER)
        self.peers.pair_used(msg.instance_id + PULL_PEER)
        self.peers.relay_rendezvous(pair, lambda m: reply(identity, m))
        reply(identity, wire.PullOffer(msg.pull_id, n, buf.numel(), pair.key, self.kv.address))
        self.serving += 1
        try:
            # Shielded: once the offer is out, its send must run (the asker posts the matching receive).
            await asyncio.shield(asyncio.wrap_future(pair.send(flat_blocks(buf, n), list(range(n)),
                                                                self._chunk(buf.numel() // n))))
        except Exception as exc:  # the asker went away or timed out: its request recomputes
            log.info("prefix pull %d to %s: the transfer failed: %s", msg.pull_id, msg.instance_id, exc)
            self.kv.forget(msg.instance_id + PULL_PEER)
            return
        finally:
            self.serving -= 1
        retention = self.engine.tier.retention if self.engine.tier is not None else None
        if msg.session and retention is not None:  # a re-homed session: its KV is retained there now, not here
            await self.boundary(lambda: retention.release(msg.session))

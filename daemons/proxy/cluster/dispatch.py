"""Dispatch: ask the manager or choose from our own view (by the manager's policy), wait for an instance that
can take the request, submit it under a new epoch."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Protocol

import msgspec

from daemons import policy, prefix, wire
from daemons.links import UP
from daemons.proxy.cluster.admission import Placing
from daemons.proxy.cluster.shared import Shared
from daemons.proxy.cluster.stream import NoInstance, Stream
from daemons.proxy.cluster.telemetry import (M_ASKED, M_CACHE_DISPATCHES, M_DISAGG, M_LOCAL, M_SESSION_DISPATCHES,
                                             M_SESSIONS, M_WAITED)
from daemons.sessions import SessionTable
from daemons.tracing import now_ns

log = logging.getLogger("llumnix.proxy")


class Manager(Protocol):
    """What dispatch asks and tells the manager (daemons/proxy/cluster/managerlink.py ManagerLink)."""

    def next_id(self) -> int: ...

    async def ask(self, msg, timeout: float): ...

    def tell_soon(self, msg: wire.Message) -> None: ...


class Changes:
    """Dispatches waiting for what instances can take to change (a heartbeat, a snapshot, a connection)."""

    def __init__(self):
        self._waiting: list[asyncio.Future] = []

    def __bool__(self) -> bool:
        return bool(self._waiting)

    async def wait(self, timeout: float) -> None:
        """Until ``wake`` (or ``timeout``)."""
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        try:
            await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            if fut in self._waiting:
                self._waiting.remove(fut)

    def wake(self) -> None:
        waiting, self._waiting = self._waiting, []
        for fut in waiting:
            if not fut.done():
                fut.set_result(None)


class Dispatcher:
    """Places each stream on an instance and submits it there. Owns the dispatch turn count. Receives the
    clock, the config, what we know of the instances (read only), the dispatch view, the prefix cache index,
    the port to the instances, the manager link, the requests placing here, the waits for a change,
    ``on_full`` (the stream's request path is full: failover's ``instance_failed``) and the sessions known here
    (each turn placed is written there)."""

    def __init__(self, shared: Shared, cache_index: prefix.Follower, manager: Manager, placing: Placing,
                 changes: Changes, on_full: Callable[..., None], sessions: SessionTable | None = None):
        self.clock, self.known, self.view, self.port = shared.clock, shared.known, shared.view, shared.port
        self.pc = shared.cfg.proxy
        self.queue_timeout_s = shared.cfg.admission.queue_timeout_s
        self.cache_index = cache_index
        self.manager = manager
        self.placing = placing
        self.changes = changes
        self.on_full = on_full
        self.sessions = sessions if sessions is not None else SessionTable(shared.cfg.sessions.max_sessions,
                                                                           shared.clock.monotonic)
        self._turn = 0

    async def _choose(self, stream: Stream) -> tuple[str, str]:
        """Where the request goes: by default from our own view (the manager hears of it afterwards);
        with proxy.dispatch = manager, before we have any view, or when our view has no instance for it (one
        that just joined may not be in it yet), the manager's answer."""
        sub = stream.submit
        if self.pc.dispatch == "local" and self.known.snapshot:
            chosen = self._choose_here(stream)
            if chosen is not None:
                return self._chose(stream, chosen)
        return await self._ask_or_choose(stream)

    def _chose(self, stream: Stream, chosen: str) -> tuple[str, str]:
        M_LOCAL.inc()
        sub = stream.submit
        keys = self._prefix_keys(stream) if sub.session else []
        self.manager.tell_soon(wire.Dispatched(sub.request_id, chosen, len(sub.prompt_token_ids), sub.priority,
                                               sub.session, keys))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s -> %s (own view: %s)", sub.request_id, chosen, self.view.describe(chosen))
        return chosen, self.known.addresses[chosen]

    async def _ask_or_choose(self, stream: Stream) -> tuple[str, str]:
        sub = stream.submit
        if self.known.manager_ok() or not self.known.snapshot:
            keys = self._prefix_keys(stream) if self._policy().prefix_aware or sub.session else []
            q = wire.Dispatch(self.manager.next_id(), sub.request_id, len(sub.prompt_token_ids), sub.priority,
                              self._excluded(stream), keys, sub.adapter, sub.session)
            reply = await self.manager.ask(q, self.pc.dispatch_timeout_s)
            if reply is not None:
                if not reply.instance_id and not any(v.instance_id not in stream.exclude for v in self.known.alive()):
                    raise NoInstance(reply.reason or "no live instance")
            if reply is not None and reply.instance_id:
                M_ASKED.inc()
                stream.disagg = reply.disagg
                stream.pull, stream.how = (reply.pull_from, reply.pull_blocks), reply.how
                self.known.set_address(reply.instance_id, reply.request_address)
                return reply.instance_id, reply.request_address
        chosen = self._choose_here(stream)
        if chosen is None:
            raise NoInstance("no live instance" if self.known.manager_ok() else
                             "no live instance (the manager is unreachable and the last snapshot has none)")
        return self._chose(stream, chosen)

    async def _place(self, stream: Stream) -> tuple[str, str]:
        """``_choose``, waiting while no instance can take the request right now but some live instance could
        later (stalled, draining, cordoned, or not in our view yet): until one can, for at most
        admission.queue_timeout_s. With no live instance at all, NoInstance at once."""
        deadline = 0.0
        try:
            while True:
                try:
                    return await self._choose(stream)
                except NoInstance as exc:
                    if not self._could_serve(stream):
                        raise
                    now = self.clock.monotonic()
                    if not deadline:
                        deadline = now + self.queue_timeout_s
                        M_WAITED.inc()
                        self.placing.add(stream.request_id, len(stream.submit.prompt_token_ids),
                                        stream.submit.sampling.max_tokens)
                        log.info("request %s: %s; waiting up to %gs for an instance (admission.queue_timeout_s)",
                                 stream.request_id, exc, self.queue_timeout_s)
                    if now >= deadline or stream.done:
                        raise NoInstance(f"{exc}; no instance could take it within {self.queue_timeout_s:g}s "
                                         f"(admission.queue_timeout_s)", "wait_timeout") from None
                    await self.changes.wait(min(deadline - now, 1.0))
        finally:
            self.placing.discard(stream.request_id)

    def _could_serve(self, stream: Stream) -> bool:
        """Whether some live instance that the request has not failed on exists, taking requests or not."""
        exclude = stream.exclude
        states = self.known.states()
        for iid in {*states, *self.known.beats}:
            if iid in exclude or states.get(iid) == "dead" or self.known.dead(iid):
                continue
            if iid in states or self.known.link_state(self.known.address(iid)) == UP:
                return True
        return False

    def _policy(self) -> policy.DispatchPolicy:
        return policy.DISPATCH.get(self.known.dispatch_policy)

    def _choose_here(self, stream: Stream) -> str | None:
        """The dispatch policy over our view (daemons/proxy/cluster/view.py ``choose``: ``policy.place``, the pool
        and then the instance): the instances' streamed loads plus our own dispatches they do not show yet; the
        manager's snapshot adds flags, a new instance's credit and ordered migrations. A request that failed
        somewhere avoids those instances."""
        self._turn += 1
        sub = stream.submit
        self.view.refresh(self.known.alive)
        roles = bool(self.view.roles)  # the disaggregation decision weighs what decode instances cache
        tiers = self._tiers(stream, any_policy=roles)
        hits = {iid: both for iid, (_, both) in tiers.items()} if tiers else None
        ask = policy.Ask(len(sub.prompt_token_ids) + len(sub.output_token_ids), sub.priority, stream.slo, hits,
                         sub.adapter, tiers, sub.session, self.sessions.home(sub.session) if sub.session else "")
        chosen = self.view.choose(self.known.alive, self._policy(), ask, self._turn, self.known.tie_start(),
                                  self._excluded(stream))
        placed = self.view.placement
        stream.pull, stream.how = (placed.pull_from, placed.pull_blocks), placed.how
        stream.tiers = tiers
        if self.view.decision:
            M_DISAGG.labels(self.view.decision).inc()
            stream.disagg = self.view.decision
        elif ask.hits is not None and not stream.exclude:
            M_CACHE_DISPATCHES.labels("cache" if self.view.by_cache else "load").inc()
        return chosen

    def _excluded(self, stream: Stream) -> list[str]:
        """Where the request may not go: the instances it failed on; and on its first placement, when admission by
        SLO found only some instances predicted to meet its target, the others (the policy chooses among those)."""
        if stream.fits is None or stream.tried:
            return stream.exclude
        others = [v.instance_id for v in self.known.alive() if v.instance_id not in stream.fits]
        if len(others) == len(self.known.alive()):  # none of them takes requests now: any
            return stream.exclude
        return [*stream.exclude, *others] if others else stream.exclude

    def _tiers(self, stream: Stream, any_policy: bool = False) -> policy.sessions.Tiers | None:
        """The request's cached leading blocks on each instance that holds some, by tier (prefix.match_tiers: in the
        engine, in the engine or its host tier), for the prefix-aware policies and a session's turn (None: another
        policy, or nothing cached anywhere). Its block hashes are computed once (vLLM's, daemons/prefix.py).
        ``any_policy``: whatever the policy (the disaggregation decision weighs what decode instances cache)."""
        follower = self.cache_index
        p = self._policy()
        if not (any_policy or p.prefix_aware or (stream.submit.session and p.follows_sessions)):
            return None
        if not len(follower.index) and not len(follower.host):
            return None
        keys = self._prefix_keys(stream)
        if not keys:
            return None
        return {iid: t for iid, t in follower.match_tiers(keys).items() if t[1]} or None

    def _prefix_keys(self, stream: Stream) -> list[int]:
        """The keys of the prompt's full blocks (vLLM's block hashes, daemons/prefix.py, at the instances' block
        size), computed once; none while no instance's block size is known yet."""
        if stream.prefix_keys is None:
            entry = next(iter(self.view.entries.values()), None)
            block_size = entry.load.block_size if entry is not None else self.known.block_size()
            if not block_size:
                return []
            sub = stream.submit
            stream.prefix_keys = prefix.keys(prefix.block_hashes(sub.prompt_token_ids, block_size,
                                                                 extra_keys=prefix.adapter_keys(sub.adapter, sub.adapter_path)))
        return stream.prefix_keys


    async def dispatch(self, stream: Stream) -> None:
        """Place the request (again) under a new epoch; a placement after tokens were streamed continues
        from them (re-prefill)."""
        since = now_ns() if stream.trace is not None else 0
        instance_id, address = await self._place(stream)
        if stream.done:  # ended (client gone, deadline) while we chose
            return
        stream.place(instance_id, address, stream.epoch + 1, stream.next_index)
        stream.tried.append(instance_id)
        stream.sent_at = stream.progress_at = self.clock.monotonic()
        stream.early.clear()  # a gap's tokens came from the copy we left: the new one sends them again
        pull_from, pull_blocks = stream.pull
        pull_address = self.known.address(pull_from) if pull_from and pull_from != instance_id else ""
        if not pull_address:  # (the holder is not known here: no pull)
            pull_from, pull_blocks = "", 0
            stream.pull = ("", 0)
        submit = msgspec.structs.replace(stream.submit, epoch=stream.epoch, output_token_ids=list(stream.token_ids),
                                         pull_from=pull_from, pull_blocks=pull_blocks, pull_address=pull_address)
        if submit.session:
            self._session_turn(stream, instance_id)
        beat = self.known.beats.get(instance_id)
        tokens = len(submit.prompt_token_ids) + len(submit.output_token_ids)
        left = max(submit.sampling.max_tokens - len(submit.output_token_ids), 1)  # what it may still generate
        if stream.predicted is None and beat is not None and beat.load is not None and beat.load.latency is not None:
            stream.predicted = self.view.predict(instance_id, beat.load, tokens, stream.slo.high, left)
            if not submit.output_token_ids:  # its first placement: the instance judges the prediction
                submit = msgspec.structs.replace(submit, predicted_ttft_ms=stream.predicted[0] * 1000.0)
        self.view.sent_to(instance_id, beat.load if beat is not None else None, tokens, left,
                          self._cached_tokens(stream, instance_id, beat))
        if stream.trace is not None:
            stream.trace.dispatched(since, instance_id, stream.epoch, len(stream.token_ids))
        if not self.port.send(address, submit):
            self.on_full(stream, f"the request path to instance {instance_id} is full", cause="full")

    def _session_turn(self, stream: Stream, instance_id: str) -> None:
        """A session's turn placed: written in the session table, counted by how it was placed."""
        sub = stream.submit
        self.sessions.placed(sub.session, instance_id, self._prefix_keys(stream), len(sub.prompt_token_ids))
        M_SESSION_DISPATCHES.labels(stream.how or "new").inc()
        M_SESSIONS.set(len(self.sessions))

    @staticmethod
    def _cached_tokens(stream: Stream, instance_id: str, beat) -> int:
        """Prompt tokens of the request that ``instance_id`` holds in its engine or host tier, or that its pull
        brings: not work that waits there (admission)."""
        tiers = stream.tiers or {}
        blocks = tiers.get(instance_id, (0, 0))[1] + stream.pull[1]
        block = beat.load.block_size if beat is not None and beat.load is not None else 16
        return min(blocks * block, len(stream.submit.prompt_token_ids))

"""Dispatch: ask the manager or choose from our own view (by the manager's policy), wait for an instance that
can take the request, submit it."""

from __future__ import annotations

import asyncio
import logging

import msgspec

from daemons import policy, prefix, wire
from daemons.links import UP
from daemons.proxy.stream import NoInstance, Stream
from daemons.proxy.telemetry import M_ASKED, M_CACHE_DISPATCHES, M_LOCAL, M_WAITED, TIE_TURN_S
from daemons.proxy.traces import StreamTrace
from daemons.tracing import now_ns

log = logging.getLogger("llumnix.proxy")


class DispatchMixin:
    """Of the ClusterClient: places each stream on an instance and submits it there."""

    async def _choose(self, stream: Stream) -> tuple[str, str]:
        """Where the request goes: by default from our own view (the manager hears of it afterwards);
        with proxy.dispatch = manager, before we have any view, or when our view has no instance for it (one
        that just joined may not be in it yet), the manager's answer."""
        sub = stream.submit
        if self.pc.dispatch == "local" and self.snapshot:
            chosen = self._choose_here(stream)
            if chosen is not None:
                return self._chose(sub, chosen)
        return await self._ask_or_choose(stream)

    def _chose(self, sub: wire.Submit, chosen: str) -> tuple[str, str]:
        M_LOCAL.inc()
        self._tell_manager_soon(wire.Dispatched(sub.request_id, chosen, len(sub.prompt_token_ids), sub.priority))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s -> %s (own view: %s)", sub.request_id, chosen, self.view.describe(chosen))
        return chosen, self.addresses[chosen]

    async def _ask_or_choose(self, stream: Stream) -> tuple[str, str]:
        sub = stream.submit
        if self.manager_ok() or not self.snapshot:
            q = wire.Dispatch(next(self._ids), sub.request_id, len(sub.prompt_token_ids), sub.priority, stream.exclude,
                              self._prefix_keys(stream) if self.dispatch_policy == "llumnix-cache" else [])
            reply = await self._ask(q, self.pc.dispatch_timeout_s)
            if reply is not None:
                if not reply.instance_id and not any(v.instance_id not in stream.exclude for v in self.alive()):
                    raise NoInstance(reply.reason or "no live instance")
            if reply is not None and reply.instance_id:
                M_ASKED.inc()
                self.addresses[reply.instance_id] = reply.request_address
                return reply.instance_id, reply.request_address
        chosen = self._choose_here(stream)
        if chosen is None:
            raise NoInstance("no live instance" if self.manager_ok() else
                             "no live instance (the manager is unreachable and the last snapshot has none)")
        return self._chose(sub, chosen)

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
                        deadline = now + self.adm.queue_timeout_s
                        M_WAITED.inc()
                        self.placing[stream.request_id] = len(stream.submit.prompt_token_ids)
                        log.info("request %s: %s; waiting up to %gs for an instance (admission.queue_timeout_s)",
                                 stream.request_id, exc, self.adm.queue_timeout_s)
                    if now >= deadline or stream.done:
                        raise NoInstance(f"{exc}; no instance could take it within {self.adm.queue_timeout_s:g}s "
                                         f"(admission.queue_timeout_s)", "wait_timeout") from None
                    await self._wait_change(min(deadline - now, 1.0))
        finally:
            self.placing.pop(stream.request_id, None)

    def _could_serve(self, stream: Stream) -> bool:
        """Whether some live instance that the request has not failed on exists, taking requests or not."""
        exclude = stream.exclude
        states = {v.instance_id: v.state for v in self.snapshot}
        for iid in {*states, *self.beats}:
            if iid in exclude or states.get(iid) == "dead" or self._dead(iid):
                continue
            if iid in states or self.links.state(self.addresses.get(iid, "")) == UP:
                return True
        return False

    async def _wait_change(self, timeout: float) -> None:
        """Until a heartbeat, a snapshot or a connection changes what instances can take (or ``timeout``)."""
        fut = asyncio.get_running_loop().create_future()
        self._changed.append(fut)
        try:
            await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            if fut in self._changed:
                self._changed.remove(fut)

    def _wake_waiting(self) -> None:
        waiting, self._changed = self._changed, []
        for fut in waiting:
            if not fut.done():
                fut.set_result(None)
        self.pump_fair_queue()

    def _choose_here(self, stream: Stream) -> str | None:
        """The dispatch policy over our view (daemons/proxy/view.py): the instances' streamed loads plus our
        own dispatches they do not show yet; the manager's snapshot adds flags, a new instance's credit and
        ordered migrations. A request that failed somewhere avoids those instances (rare: built afresh)."""
        self._turn += 1
        priority = stream.submit.priority
        sc = self.cfg.scheduling
        hits = self._cache_hits(stream)
        if not stream.exclude:
            chosen = self.view.choose(self.alive, self.dispatch_policy, priority, self._turn, self.tie_start(), hits,
                                      sc.cache_band, sc.cache_min_freeness)
            if hits is not None:
                M_CACHE_DISPATCHES.labels("cache" if self.view.by_cache else "load").inc()
            return chosen
        now = self.clock.monotonic()
        states = [self.view.state_of(v, v.load, now) for v in self.alive() if v.instance_id not in stream.exclude]
        return policy.dispatch(self.dispatch_policy, states, self._turn, sc.high_priority_headroom, priority,
                               start=self.tie_start(), hits=hits, cache_band=sc.cache_band,
                               cache_floor=sc.cache_min_freeness)

    def _cache_hits(self, stream: Stream) -> dict[str, int] | None:
        """llumnix-cache: the request's cached leading blocks on each instance that holds some (None: another
        policy, or nothing cached anywhere). Its block hashes are computed once (vLLM's, daemons/prefix.py)."""
        index = self.cache_index.index
        if self.dispatch_policy != "llumnix-cache" or not len(index):
            return None
        keys = self._prefix_keys(stream)
        if not keys:
            return None
        return {iid: n for iid, n in index.match(keys).items() if n} or None

    def _prefix_keys(self, stream: Stream) -> list[int]:
        """The keys of the prompt's full blocks (vLLM's block hashes, daemons/prefix.py, at the instances' block
        size), computed once; none while no instance's block size is known yet."""
        if stream.prefix_keys is None:
            entry = next(iter(self.view.entries.values()), None)
            block_size = entry.load.block_size if entry is not None else next(
                (v.load.block_size for v in self.snapshot if v.load.block_size), 0)
            if not block_size:
                return []
            stream.prefix_keys = prefix.keys(prefix.block_hashes(stream.submit.prompt_token_ids, block_size))
        return stream.prefix_keys

    def tie_start(self) -> float:
        """Where our ties start among the instances: the proxies' starts are evenly spaced by their ranks, and
        all move on together every TIE_TURN_S (wall clock), so that over time no instance is always the first
        tie; seldom enough that a burst almost never straddles a turn (its proxies would start anew)."""
        return (self.clock.time() // TIE_TURN_S * 0.618034 + self.rank / max(self.proxies, 1)) % 1.0

    async def submit(self, submit: wire.Submit, tenant: str = "", weight: float = 1.0) -> Stream:
        """Dispatch and send a request; the returned stream yields its tokens. Raises NoInstance. ``tenant``:
        the name of its API key, for the fair queue between keys (daemons/proxy/fairgate.py); ``weight``: that
        key's share."""
        stream = Stream(submit.request_id, submit, self.pc.request_timeout_s, self.clock.monotonic())
        if self.tracer is not None and submit.traceparent:
            stream.trace = StreamTrace(self.tracer, submit.traceparent)
        self.streams[submit.request_id] = stream
        try:
            if tenant and self.fair is not None and submit.priority <= 0:  # high priority does not queue here
                since = now_ns() if stream.trace is not None else 0
                turn = await self._take_turn(stream, tenant, weight)
                if stream.trace is not None:
                    stream.trace.queued(since, tenant, turn)
                if turn:
                    try:
                        if not stream.done:
                            await self._dispatch(stream)
                    finally:
                        self._turn_taken()
            else:
                await self._dispatch(stream)
        except BaseException:
            self.streams.pop(submit.request_id, None)
            self._turn_ended(stream)
            raise
        return stream

    async def _dispatch(self, stream: Stream) -> None:
        """Place the request (again) under a new epoch; a placement after tokens were streamed continues
        from them (re-prefill)."""
        since = now_ns() if stream.trace is not None else 0
        instance_id, address = await self._place(stream)
        if stream.done:  # ended (client gone, deadline) while we chose
            return
        stream.instance_id, stream.address = instance_id, address
        stream.tried.append(instance_id)
        stream.sent_at = stream.progress_at = self.clock.monotonic()
        stream.epoch += 1
        stream.owner_from = stream.next_index
        stream.early.clear()  # a gap's tokens came from the copy we left: the new one sends them again
        submit = msgspec.structs.replace(stream.submit, epoch=stream.epoch, output_token_ids=list(stream.token_ids))
        beat = self.beats.get(instance_id)
        self.view.sent_to(instance_id, beat.load if beat is not None else None,
                          len(submit.prompt_token_ids) + len(submit.output_token_ids))
        if stream.trace is not None:
            stream.trace.dispatched(since, instance_id, stream.epoch, len(stream.token_ids))
        if not self._send_instance(address, submit):
            self._instance_failed(stream, f"the request path to instance {instance_id} is full", cause="full")

"""Failover and fencing: a stream whose instance died, stalled, stopped or refused continues on another by
re-prefill under a new epoch; copies that lost a race are fenced; streams past their deadline end; Submits an
instance never took in are sent again."""

from __future__ import annotations

import logging
from collections import deque
from typing import Awaitable, Callable

import msgspec

from daemons import wire
from daemons.links import DOWN
from daemons.proxy.cluster.shared import Shared
from daemons.proxy.cluster.stream import NoInstance, Stream
from daemons.proxy.cluster.streams import Streams
from daemons.proxy.cluster.telemetry import M_FAILOVERS, M_GAVE_UP, M_GIVEN_BACK, M_RESENT, M_RETRIES, M_TIMEOUTS

log = logging.getLogger("llumnix.proxy")

FORGET_AFTER_S = 60.0  # an instance neither live in the manager's view nor heard from this long is forgotten


class Failover:
    """Watches the streams and the instances that hold them. Owns the count of Submits sent per instance at
    its heartbeats (``check_taken``). Receives the clock, the proxy and manager settings, the streams
    (daemons/proxy/cluster/streams.py), what we know of the instances (known.py, read only), the dispatch view (its
    count of our Submits), the port to the instances, ``dispatch`` (a stream placed again under a new epoch)
    and ``spawn`` (runs a coroutine as the client's task)."""

    def __init__(self, shared: Shared, streams: Streams, dispatch: Callable[[Stream], Awaitable[None]],
                 spawn: Callable[[Awaitable], None]):
        self.clock, self.known, self.view, self.port = shared.clock, shared.known, shared.view, shared.port
        self.pc, self.mc = shared.cfg.proxy, shared.cfg.manager
        self.streams = streams
        self.dispatch = dispatch
        self.spawn = spawn
        self._sent_counts: dict[str, deque] = {}  # instance id -> (time, Submits sent) at its heartbeats

    def instance_failed(self, stream: Stream, message: str, retryable: bool = True, status: int = 503,
                        cause: str = "failed") -> None:
        """The stream's owner failed it, died, stalled or went unhealthy: place it elsewhere, or fail it."""
        if stream.done:
            return
        pc = self.pc
        if retryable and stream.next_index == 0 and len(stream.tried) - stream.given_back < pc.max_dispatch_attempts:
            log.warning("request %s: %s; sending it elsewhere", stream.request_id, message)
            M_RETRIES.inc()
        elif retryable and stream.next_index > 0 and stream.failovers < pc.max_failovers:
            stream.failovers += 1
            M_FAILOVERS.labels(cause).inc()
            log.warning("request %s: %s; continuing it elsewhere from token %d (failover %d of %d)", stream.request_id,
                        message, stream.next_index, stream.failovers, pc.max_failovers)
        else:
            if stream.next_index:
                message += f" after {stream.next_index} tokens (proxy.max_failovers = {pc.max_failovers})"
            stream.fail(message, status)
            return
        if stream.trace is not None:
            stream.trace.failed(cause, message, stream.instance_id, stream.next_index)
        self.streams.fence_owner(stream)
        if stream.instance_id and stream.instance_id not in stream.exclude:
            stream.exclude.append(stream.instance_id)
        stream.instance_id = stream.address = ""
        self.spawn(self.redispatch(stream, message))

    def give_back(self, stream: Stream, msg: wire.Redispatch) -> None:
        """A draining instance gave a queued request back: dispatch it again (not a failed attempt)."""
        if stream.next_index:  # it produced tokens meanwhile (cannot happen: the instance checks); keep it there
            return
        log.debug("request %s: instance %s gave it back (%s); dispatching it again", stream.request_id,
                  msg.instance_id, msg.reason or "draining")
        M_GIVEN_BACK.inc()
        if stream.trace is not None:
            stream.trace.failed("given_back", f"instance {msg.instance_id} gave it back ({msg.reason or 'draining'})",
                                msg.instance_id, 0)
        stream.given_back += 1
        stream.instance_id = stream.address = ""
        self.spawn(self.redispatch(stream, f"instance {msg.instance_id} gave it back"))

    async def redispatch(self, stream: Stream, why: str) -> None:
        try:
            await self.dispatch(stream)
        except NoInstance as exc:
            stream.fail(f"{why}; no other instance: {exc}")
        except Exception as exc:  # the client must hear of it now, not at its deadline
            log.exception("request %s: dispatching it again failed", stream.request_id)
            stream.fail(f"{why}; dispatching it again failed: {type(exc).__name__}: {exc}")

    def refused(self, stream: Stream, msg: wire.RequestFailed) -> None:
        # A request that already streamed tokens was valid: an instance that refuses to continue it (a
        # smaller context limit or cache) is that instance's limit, not the request's.
        retryable = msg.retryable or (stream.next_index > 0 and msg.status == 400)
        self.instance_failed(stream, msg.message, retryable, msg.status, cause="refused")

    def forget(self, instance_id: str) -> None:
        self._sent_counts.pop(instance_id, None)

    # ------------------------------------------------------------------ checks

    def check_taken(self, beat: wire.Heartbeat) -> None:
        """Queued requests are not judged by silence (a saturated instance may hold one for long), but one
        its instance never took in would wait out its deadline: a Submit lost on the way (a connection that
        broke), or sent to an instance that restarted. The heartbeats count the Submits the instance took in
        from us; when they are short of what we had sent proxy.stall_timeout_s before, every request of ours
        on it that has no token yet and was sent before then is sent again, same epoch (a copy the instance
        holds ignores it)."""
        stall = self.pc.stall_timeout_s
        if not stall:
            return
        iid = beat.instance_id
        now = self.clock.monotonic()
        history = self._sent_counts.get(iid)
        if history is None:
            history = self._sent_counts[iid] = deque()
        history.append((now, self.view.sent.get(iid, 0)))
        while len(history) > 1 and history[1][0] <= now - stall:
            history.popleft()
        at, sent = history[0]
        if at > now - stall or beat.taken >= sent:
            return
        history.clear()
        self.view.lost(iid, sent - beat.taken)
        again = [s for s in self.streams if s.instance_id == iid and not s.done and not s.next_index
                 and not s.early and s.sent_at <= at]
        for stream in again:
            submit = msgspec.structs.replace(stream.submit, epoch=stream.epoch, output_token_ids=[])
            if self.port.send(stream.address, submit):
                self.view.resent(iid)
        M_RESENT.inc(len(again))
        log.warning("instance %s took in %d of the %d requests we had sent it %gs ago: sent again the %d of ours "
                    "on it with no token yet", iid, beat.taken, sent, stall, len(again))

    def check_streams(self, now: float) -> None:
        """Streams past their deadline end; those whose instance is dead, silent, unhealthy or stalled fail over."""
        pc = self.pc
        stall = pc.stall_timeout_s
        for stream in self.streams:
            if stream.done:
                continue
            if stream.deadline and now > stream.deadline:
                M_TIMEOUTS.inc()
                self.streams.fence_owner(stream)
                stream.fail(f"the request did not finish within proxy.request_timeout_s "
                            f"({pc.request_timeout_s:g}s)", 504)
                continue
            if stream.first_by and now > stream.first_by and not stream.next_index and not stream.early:
                M_GAVE_UP.inc()
                self.streams.fence_owner(stream)  # (aborts it where it queues)
                stream.fail("the request waited past its time-to-first-token target without starting "
                            "(slo.give_up_factor); the cluster is overloaded: retry later", 429)
                continue
            iid = stream.instance_id
            if not iid:  # being placed
                continue
            beat = self.known.beats.get(iid)
            if self.known.dead(iid, stream.sent_at):
                if self.known.link_state(stream.address) == DOWN:
                    self.instance_failed(stream, f"lost the connection to instance {iid} (its process is gone, or "
                                         f"it answered no keepalive for {pc.instance_timeout_s:g}s)", cause="dead")
                else:
                    self.instance_failed(stream, f"instance {iid} has not been heard from for over "
                                         f"{pc.instance_timeout_s:g}s (its connection never came up)",
                                         cause="silent")
            elif beat is not None and not beat.healthy:
                self.instance_failed(stream, f"instance {iid} is unhealthy (its engine makes no progress)",
                                     cause="unhealthy")
            elif stall and (stream.next_index or stream.early) and now - stream.progress_at > stall:
                self.instance_failed(stream, f"no token for {now - stream.progress_at:.1f}s on instance {iid}"
                                     f"{' (a token is missing)' if stream.early else ''}", cause="stalled")

    def check_gone(self, manager_uptime_s: float, asked_at: float) -> None:
        """Requests on an instance the manager marked dead, or no longer knows, are re-sent or failed. A
        manager that has just (re)started does not know every instance yet: absence counts only later.
        ``asked_at``: when we asked for the snapshot that says so."""
        states = self.known.states()
        mc = self.mc
        settled = manager_uptime_s > 2 * mc.heartbeat_interval_s * mc.dead_after_missed
        for stream in self.streams:
            if stream.done or not stream.instance_id:
                continue
            iid = stream.instance_id
            state = states.get(iid)
            # The manager's word is confirmed by our own view: an instance whose tokens or heartbeats reached
            # us within the manager's own dead-after time is alive, whatever a loaded manager concluded.
            heard_lately = self.known.heard_within(iid, mc.heartbeat_interval_s * mc.dead_after_missed)
            # Absent: gone for good, unless we sent the request after the manager took this snapshot, or the
            # manager has only just (re)started.
            gone = state is None and settled and stream.sent_at < asked_at
            if (state == "dead" or gone) and not heard_lately:
                self.instance_failed(stream, f"instance {stream.instance_id} died", cause="dead")

"""Failover and fencing: a stream whose instance died, stalled, stopped or refused continues on another by
re-prefill under a new epoch; copies that lost a race are fenced; streams past their deadline end."""

from __future__ import annotations

import asyncio
import logging
from collections import deque

import msgspec

from daemons import wire
from daemons.links import DOWN
from daemons.proxy.stream import NoInstance, Stream
from daemons.proxy.telemetry import M_FAILOVERS, M_GIVEN_BACK, M_RESENT, M_RETRIES, M_TIMEOUTS

log = logging.getLogger("llumnix.proxy")

FORGET_AFTER_S = 60.0  # an instance neither live in the manager's view nor heard from this long is forgotten


class FailoverMixin:
    """Of the ClusterClient: watches the streams and the instances that hold them."""

    def _instance_failed(self, stream: Stream, message: str, retryable: bool = True, status: int = 503,
                         cause: str = "failed") -> None:
        """The stream's owner failed it, died, stalled or went unhealthy: place it elsewhere, or fail it."""
        if stream.done:
            return
        if retryable and stream.next_index == 0 and len(stream.tried) - stream.given_back < self.pc.max_dispatch_attempts:
            log.warning("request %s: %s; sending it elsewhere", stream.request_id, message)
            M_RETRIES.inc()
        elif retryable and stream.next_index > 0 and stream.failovers < self.pc.max_failovers:
            stream.failovers += 1
            M_FAILOVERS.labels(cause).inc()
            log.warning("request %s: %s; continuing it elsewhere from token %d (failover %d of %d)", stream.request_id,
                        message, stream.next_index, stream.failovers, self.pc.max_failovers)
        else:
            if stream.next_index:
                message += f" after {stream.next_index} tokens (proxy.max_failovers = {self.pc.max_failovers})"
            stream.fail(message, status)
            return
        if stream.trace is not None:
            stream.trace.failed(cause, message, stream.instance_id, stream.next_index)
        self._fence_owner(stream)
        if stream.instance_id and stream.instance_id not in stream.exclude:
            stream.exclude.append(stream.instance_id)
        stream.instance_id = stream.address = ""
        self._spawn(self._redispatch(stream, message))

    def _fence_owner(self, stream: Stream) -> None:
        """The copy we leave may still be running (a stalled or unhealthy instance): abort it by epoch."""
        if stream.address:
            self._fence(stream, stream.instance_id, stream.epoch, stream.address)

    def _fence(self, stream: Stream, instance_id: str, epoch: int, address: str = "") -> None:
        key = (instance_id, epoch)
        if key in stream.fenced:
            return
        stream.fenced.add(key)
        address = address or self.addresses.get(instance_id, "")
        if address:
            self._send_instance(address, wire.Abort(stream.request_id, epoch))

    def _give_back(self, stream: Stream, msg: wire.Redispatch) -> None:
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
        self._spawn(self._redispatch(stream, f"instance {msg.instance_id} gave it back"))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    async def _redispatch(self, stream: Stream, why: str) -> None:
        try:
            await self._dispatch(stream)
        except NoInstance as exc:
            stream.fail(f"{why}; no other instance: {exc}")
        except Exception as exc:  # the client must hear of it now, not at its deadline
            log.exception("request %s: dispatching it again failed", stream.request_id)
            stream.fail(f"{why}; dispatching it again failed: {type(exc).__name__}: {exc}")

    def finish(self, stream: Stream) -> None:
        """Forget a stream; abort it on its instance if it is still running there (client went away, stop string)."""
        self.streams.pop(stream.request_id, None)
        self._turn_ended(stream)
        if stream.trace is not None:
            stream.trace.finished(stream.next_index, stream.error)
        if not stream.done and stream.address:
            self._send_instance(stream.address, wire.Abort(stream.request_id, stream.epoch))
        stream.done = True

    # ------------------------------------------------------------------ liveness

    async def _watch(self) -> None:
        """Each heartbeat: tell the instances we are here; fail over streams whose instance is silent,
        unhealthy or stalled; end requests past their deadline."""
        period = min(self.cfg.manager.heartbeat_interval_s, self.pc.instance_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            alive = wire.ProxyAlive(self.token_address)
            for address in list(self.instances):
                self._send_instance(address, alive)
            now = self.clock.monotonic()
            self.check_streams(now)
            self.forget_departed(now)
            if self.fair is not None:
                self.fair.forget_idle()
                self.pump_fair_queue()  # our own dispatches age out of the room count

    def forget_departed(self, now: float) -> None:
        """Instances gone for good: not live in the manager's view, holding none of our streams and not heard
        from for ``FORGET_AFTER_S``. Their sockets (and link watches) close and their records go, or a fleet
        that restarts instances on new ports would grow the proxy, and its heartbeats, for ever."""
        if not self.manager_ok():  # without a current view, absence from it says nothing
            return
        live = {v.instance_id for v in self.snapshot if v.state != "dead"}
        for iid in [i for i, at in self.heard.items() if i not in live and now - at > FORGET_AFTER_S]:
            for table in (self.heard, self.beats, self.beat_at, self.addresses, self._sent_counts, self.owner_keys):
                table.pop(iid, None)
            self.cache_index.forget(iid)
        keep = ({v.request_address for v in self.snapshot if v.state != "dead"}
                | {s.address for s in self.streams.values() if s.address}
                | {self.addresses[i] for i in self.heard if i in self.addresses})
        for address in [a for a in self.instances if a not in keep]:
            self.links.forget(address)
            self.instances.pop(address).close(0)

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
        self.view.sent[iid] = self.view.sent.get(iid, 0) - (sent - beat.taken)  # the lost ones: never to be counted
        again = [s for s in self.streams.values() if s.instance_id == iid and not s.done and not s.next_index
                 and not s.early and s.sent_at <= at]
        for stream in again:
            submit = msgspec.structs.replace(stream.submit, epoch=stream.epoch, output_token_ids=[])
            if self._send_instance(stream.address, submit):
                self.view.sent[iid] = self.view.sent.get(iid, 0) + 1  # it counts this one too, taken in or not
        M_RESENT.inc(len(again))
        log.warning("instance %s took in %d of the %d requests we had sent it %gs ago: sent again the %d of ours "
                    "on it with no token yet", iid, beat.taken, sent, stall, len(again))

    def check_streams(self, now: float) -> None:
        stall = self.pc.stall_timeout_s
        for stream in list(self.streams.values()):
            if stream.done:
                continue
            if stream.deadline and now > stream.deadline:
                M_TIMEOUTS.inc()
                self._fence_owner(stream)
                stream.fail(f"the request did not finish within proxy.request_timeout_s "
                            f"({self.pc.request_timeout_s:g}s)", 504)
                continue
            iid = stream.instance_id
            if not iid:  # being placed
                continue
            beat = self.beats.get(iid)
            if self._dead(iid, stream.sent_at):
                if self.links.state(stream.address) == DOWN:
                    self._instance_failed(stream, f"lost the connection to instance {iid} (its process is gone, or "
                                          f"it answered no keepalive for {self.pc.instance_timeout_s:g}s)", cause="dead")
                else:
                    self._instance_failed(stream, f"instance {iid} has not been heard from for over "
                                          f"{self.pc.instance_timeout_s:g}s (its connection never came up)",
                                          cause="silent")
            elif beat is not None and not beat.healthy:
                self._instance_failed(stream, f"instance {iid} is unhealthy (its engine makes no progress)",
                                      cause="unhealthy")
            elif stall and (stream.next_index or stream.early) and now - stream.progress_at > stall:
                self._instance_failed(stream, f"no token for {now - stream.progress_at:.1f}s on instance {iid}"
                                      f"{' (a token is missing)' if stream.early else ''}", cause="stalled")

"""Load reports to the manager (on change, coalesced to a bounded rate, and at least once per heartbeat) with
the same load in heartbeats to the proxies; and the heartbeat tick that tells the proxies we are alive and
finds the proxies that are gone."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Callable, Mapping, Protocol

import msgspec

from daemons import metrics, runtime, wire
from daemons.clock import Clock
from daemons.config import Config
from daemons.instance.adapters import AdapterCounts
from daemons.instance.attainment import Attainment
from daemons.instance.outlook import outlook
from daemons.instance.predictor import StepFit
from daemons.instance.shared import Shared
from daemons.instance.telemetry import (
    M_BEAT_LATE, M_BLOCKS_TOTAL, M_BLOCKS_USED, M_HEALTHY, M_KV_USAGE, M_PREDICTED_TPOT, M_PREDICTED_TTFT,
    M_PREEMPTIONS, M_RUNNING, M_SLO_ATTAINMENT, M_SLO_JUDGED, M_SLO_MET, M_WAITING, tier_gauges)
from daemons.policy import slo
from daemons.requests import RequestTable
from daemons.watchdog import Watchdog

log = logging.getLogger("llumnix.instance")
OUTLOOK_MAX_AGE_S = 0.5  # an outlook of the same requests is aged, not computed again, for at most this long


class ReportedCache(Protocol):
    """What the reports read of the prefix cache's publication (daemons/instance/cache.py's CacheReports, or the
    simulator's)."""

    def publish(self) -> None: ...  # the changes since the last report go out first

    def position(self) -> tuple[int, int] | tuple[()]: ...  # (epoch, seq) the report carries

    def count(self) -> None: ...  # its metrics


class BeatLinks(Protocol):
    """The proxies the instance serves, as the reports and heartbeats reach them (daemons/proxylinks.py's
    ProxyLinks, or the simulator's proxy)."""

    links: Mapping  # address -> link, of every proxy we know

    def heartbeat(self, msg: wire.Heartbeat, taken: Mapping[str, int] | None = None) -> None: ...

    def gone(self, addresses: set[str]) -> list[tuple[str, str]]: ...


class Reporter:
    """Owns the last load (``last``, as of the last step or boundary, with the llumlet's own state), the
    event that says it changed, and the report sequence. Reads the engine, the migrator's counts, the
    watchdog's verdict, the Submits taken per proxy (``taken``), where the instance stands, the step-time
    model (``fit``) and the SLO attainment over its window (``attainment``)."""

    def __init__(self, shared: Shared, cfg: Config, watchdog: Watchdog, proxies: BeatLinks,
                 taken: Mapping[str, int], cache: ReportedCache, fit: StepFit | None = None,
                 attainment: Attainment | None = None):
        """``cfg``: its periods (manager.heartbeat_interval_s, instance.load_report_min_interval_s)."""
        self.engine, self.migrator, self.tell_manager = shared.engine, shared.migrator, shared.tell_manager
        self.standing, self.ident, self.phases = shared.standing, shared.ident, shared.phases
        self.requests, self.clock = shared.requests, shared.clock
        self.fit = fit  # the step-time model the reports carry (None: none)
        self.attainment = attainment  # the SLO attainment over its window the reports carry (None: none)
        self.watchdog = watchdog
        self.proxies = proxies
        self.taken = taken
        self.cache = cache
        self.heartbeat_s = cfg.manager.heartbeat_interval_s
        self.min_interval_s = cfg.instance.load_report_min_interval_s
        # The last outlook, and when, of which requests (their counts) and at which tokens_generated (``with_outlook``).
        self._outlook: wire.Outlook | None = None
        self._outlook_at = 0.0
        self._outlook_key: tuple = ()
        self._outlook_tokens = 0
        self.last = self._with_role(self.engine.load())
        self.load_changed = asyncio.Event()
        self.seq = 0
        self.preemptions = metrics.PreemptionCounter(M_PREEMPTIONS, self.last.preemptions)
        self.adapter_counts = AdapterCounts(self.engine)

    def current_load(self, load: wire.InstanceLoad | None = None) -> wire.InstanceLoad:
        """The engine's load (``load``: as the engine thread just read it) with the llumlet's own state."""
        load = self.with_outlook(self.engine.load()) if load is None else load
        m = self.migrator()
        if m is not None and (m.busy or m.committed or m.aborted):
            load = msgspec.structs.replace(load, migrating_out=len(m.outgoing), migrating_in=len(m.incoming),
                                           migrations_committed=m.committed, migrations_aborted=m.aborted)
        if self.watchdog.stalled:
            load = msgspec.structs.replace(load, stalled=True)
        if self.fit is not None:
            latency = self.fit.fit()
            if latency is not None:
                load = msgspec.structs.replace(load, latency=latency)
        cache = self.engine.cache
        if cache is not None and cache.query_tokens:
            load = msgspec.structs.replace(load, prefix_query_tokens=cache.query_tokens, prefix_hit_tokens=cache.hit_tokens)
        return self._with_role(load)

    def with_outlook(self, load: wire.InstanceLoad, rows: list[wire.RequestLoad] | None = None) -> wire.InstanceLoad:
        """(Between steps, or on the engine thread right after one) ``load`` with what its requests will still
        claim (daemons/instance/outlook.py), when the step-time model keeps output lengths ([slo] on);
        ``rows``: the engine's request rows, when just read."""
        if self.fit is None or self.fit.lengths is None:
            return load
        now = self.clock.monotonic()
        key = (load.running, load.waiting, load.requests_received, load.preemptions, load.migrating_out,
               load.migrating_in)
        cached = self._outlook
        if rows is None and cached is not None and key == self._outlook_key and now - self._outlook_at < OUTLOOK_MAX_AGE_S:
            # The same requests as when it was computed (none started, finished, came or left since): only older,
            # by the decode steps run since (reading every request each step costs, on the engine's thread).
            steps = (load.tokens_generated - self._outlook_tokens) // max(load.running, 1)
            if steps > 0:
                cached = msgspec.structs.replace(cached, drain=[(max(r - steps, 1), d, f) for r, d, f in cached.drain])
            return msgspec.structs.replace(load, outlook=cached)
        rows = self.engine.requests() if rows is None else rows
        hands_over = getattr(self.standing, "role", "mixed") == "prefill"
        self._outlook = outlook(rows, self.fit.lengths, load.block_size, hands_over)
        self._outlook_at, self._outlook_key, self._outlook_tokens = now, key, load.tokens_generated
        return msgspec.structs.replace(load, outlook=self._outlook)

    def _with_role(self, load: wire.InstanceLoad) -> wire.InstanceLoad:
        """``load`` with the instance's role, and its KV block's bytes where its host tier knows them (what pricing
        a pull or a restore reads: daemons/policy/sessions.py)."""
        role = getattr(self.standing, "role", "mixed")
        tier = self.engine.tier
        nbytes = tier.block_nbytes if tier is not None else 0
        if load.role == role and load.block_nbytes == nbytes:
            return load
        return msgspec.structs.replace(load, role=role, block_nbytes=nbytes)

    def refresh(self, load: wire.InstanceLoad | None = None) -> None:
        """(At a boundary, or after a step with the load it read) The load is current: report it."""
        self.last = self.current_load(load)
        self.load_changed.set()

    def changed(self) -> None:
        """Something the reports carry changed (draining, the role): report soon."""
        self.last = self._with_role(self.last)
        self.load_changed.set()

    def stalled(self) -> None:
        """The watchdog finds us stalled: say so now, not at the next step."""
        if not self.last.stalled:
            self.last = msgspec.structs.replace(self.last, stalled=True)
            self.load_changed.set()

    async def run(self) -> None:
        """Report on change, at most once per min interval, and at least once per heartbeat."""
        while True:
            await runtime.wait_event(self.load_changed, self.heartbeat_s)
            self.load_changed.clear()
            load = self.with_attainment(self.last)  # of now: the window moves on while the load stands still
            self.seq += 1
            self.cache.publish()  # before the report and heartbeats that give its number
            self.tell_manager(wire.LoadReport(self.ident.instance_id, self.seq, load, *self.cache.position()))
            self.beat_proxies(not self.watchdog.stalled)
            M_BLOCKS_USED.set(load.blocks_used)
            self.cache.count()
            tier_gauges(load)
            M_BLOCKS_TOTAL.set(load.blocks_total)
            M_KV_USAGE.set(load.blocks_used / load.blocks_total if load.blocks_total else 0.0)
            M_RUNNING.set(load.running)
            M_WAITING.set(load.waiting)
            self.preemptions.update(load.preemptions)
            self.adapter_counts.count(load)
            self.count_slo(load)
            if len(self.phases) > len(self.requests):  # some left by migration or a failure
                self.phases.prune(self.requests)
            await self.clock.sleep(self.min_interval_s)

    def with_attainment(self, load: wire.InstanceLoad) -> wire.InstanceLoad:
        if self.attainment is None:
            return load
        met, judged = self.attainment.counts()
        p50, p90, n = self.attainment.errors.stats()
        if (judged, met, n, p50, p90) == (load.slo_judged, load.slo_met, load.ttft_error_judged, load.ttft_error_p50,
                                          load.ttft_error_p90):
            return load
        return msgspec.structs.replace(load, slo_met=met, slo_judged=judged, ttft_error_p50=p50, ttft_error_p90=p90,
                                       ttft_error_judged=n)

    def count_slo(self, load: wire.InstanceLoad) -> None:
        """The SLO gauges: predictions for the reference prompt, attainment over the window."""
        if not metrics.counting():
            return
        ttft, tpot = slo.reference_prediction(self.ident.instance_id, load)
        if ttft is not None:
            M_PREDICTED_TTFT.set(ttft)
            M_PREDICTED_TPOT.set(tpot)
        M_SLO_JUDGED.set(load.slo_judged)
        M_SLO_MET.set(load.slo_met)
        M_SLO_ATTAINMENT.set(load.slo_met / load.slo_judged if load.slo_judged else math.nan)

    def beat_proxies(self, healthy: bool) -> None:
        """Liveness and load to every proxy we serve: each heartbeat, and on every load change, so that proxies
        dispatch from a current view. ``taken`` and the load are of the same step boundary, which lets a proxy
        retire exactly the dispatches the load already counts."""
        epoch, seq = self.cache.position() or (0, 0)
        self.proxies.heartbeat(wire.Heartbeat(self.ident.instance_id, self.ident.request_address, healthy, self.last,
                                              self.standing.open, cache_epoch=epoch, cache_seq=seq), self.taken)


class Heartbeats:
    """Each heartbeat: tell every proxy we serve that we are alive (and whether healthy), and hand the proxies
    that are gone to ``on_gone(address, why)``. Also the event loop's tick for the watchdog."""

    def __init__(self, reporter: Reporter, watchdog: Watchdog, proxies: BeatLinks, requests: RequestTable,
                 on_gone: Callable[[str, str], None], period_s: float, clock: Clock):
        self.reporter = reporter
        self.watchdog = watchdog
        self.proxies = proxies
        self.requests = requests
        self.on_gone = on_gone
        self.period_s = period_s
        self.clock = clock

    async def run(self) -> None:
        due = self.clock.monotonic()
        while True:
            now = self.clock.monotonic()
            M_BEAT_LATE.observe(max(now - due, 0.0))
            due = now + self.period_s
            self.watchdog.loop_ticked(now)
            healthy = not self.watchdog.stalled
            M_HEALTHY.set(1 if healthy else 0)
            if not healthy:
                self.reporter.stalled()  # the manager stops dispatching to us now, not at the next step
            self.reporter.beat_proxies(healthy)
            # Every proxy we know, with requests here or not: a gone one's link (and our heartbeats to it) goes too.
            for address, why in self.proxies.gone(self.requests.proxies() | set(self.proxies.links)):
                self.on_gone(address, why)
            await self.clock.sleep(self.period_s)

"""The engine's prefix cache, published to the manager and the proxies (daemons/prefix.py): its changes in
numbered batches before each load report, the whole cache to whoever asks (CacheSync), and its metrics. The host
KV tier's blocks (daemons/engine/tier.py) travel with them, as the HOST tier (``prefix.HOST``)."""

from __future__ import annotations

from daemons import prefix
from daemons.instance.shared import Shared
from daemons.instance.telemetry import (M_PREFIX_BLOCKS, M_PREFIX_HIT, M_PREFIX_QUERIED, M_PREFIX_TOKENS,
                                       M_RESTORE_S, M_RESTORED_BYTES)
from daemons.proxylinks import ProxyLinks


class CacheReports:
    """Owns the publisher (None when the engine keeps no cache it can report: sim.prefix_caching off; vLLM's
    events are not read yet), when each asker last got the whole cache, and the counts already in the
    metrics. The engine is read only while the engine thread is not in a step (``mailbox``)."""

    def __init__(self, shared: Shared, proxies: ProxyLinks, heartbeat_s: float):
        self.engine, self.tell_manager, self.mailbox, self.clock = (shared.engine, shared.tell_manager, shared.mailbox,
                                                                    shared.clock)
        self.proxies = proxies
        self.heartbeat_s = heartbeat_s
        self.pub = prefix.Publisher("") if self.engine.cache is not None else None
        self._syncs: dict[str, float] = {}  # asker -> when we last sent it our whole cache
        self._counted = (0, 0)  # the cache's (queried, hit) tokens already in the metrics
        self._sources: dict[str, int] = {}  # its prompt tokens by source already in the metrics
        self._restored = 0  # the tier's restored bytes already in the metrics

    def name(self, instance_id: str) -> None:
        """The instance's id, known once it bound its request socket: its batches carry it."""
        if self.pub is not None:
            self.pub.instance_id = instance_id

    def position(self) -> tuple[int, int] | tuple[()]:
        """(epoch, seq) of the last batch, for reports and heartbeats; () when nothing is published."""
        return (self.pub.epoch, self.pub.seq) if self.pub is not None else ()

    def collect(self) -> None:
        """The engine's prefix-cache changes into the publisher, unless a step is running on the engine thread
        (then the boundary collects them)."""
        if self.pub is not None and not self.mailbox.engine_busy:
            self.pub.add(self.engine.cache_events())

    def publish(self) -> None:
        """(Before a load report, which gives its number) The changes since the last batch, to the manager
        and every proxy; and the metrics."""
        if self.pub is None:
            return
        self.collect()
        batch = self.pub.take()
        if batch is not None:
            self.tell_manager(batch)
            self.proxies.broadcast(batch)

    def count(self) -> None:
        if self.pub is None:
            return
        cache = self.engine.cache
        M_PREFIX_BLOCKS.set(len(cache))
        queried, hit = self._counted
        M_PREFIX_QUERIED.inc(cache.query_tokens - queried)
        M_PREFIX_HIT.inc(cache.hit_tokens - hit)
        self._counted = (cache.query_tokens, cache.hit_tokens)
        for source, n in cache.by_source.items():
            M_PREFIX_TOKENS.labels(source).inc(n - self._sources.get(source, 0))
            self._sources[source] = n
        tier = self.engine.tier
        if tier is not None:
            M_RESTORED_BYTES.inc(tier.restored_bytes - self._restored)
            self._restored = tier.restored_bytes
            for seconds in tier.take_restore_times():
                M_RESTORE_S.observe(seconds)

    def on_sync(self, reply_to: str) -> None:
        """A proxy (``reply_to``, its token address) or the manager ("") asks for our whole prefix cache: sent
        at the next boundary (the engine idle), to a proxy we serve only, once per half heartbeat per asker."""
        if self.pub is None or (reply_to and reply_to not in self.proxies.links):
            return
        now = self.clock.monotonic()
        if now - self._syncs.get(reply_to, -1e18) < self.heartbeat_s / 2:
            return
        self._syncs[reply_to] = now
        if len(self._syncs) > 1000:
            self._syncs = {a: t for a, t in self._syncs.items() if a == reply_to or a in self.proxies.links}

        def answer() -> None:
            self.collect()
            full = self.pub.full(self.engine.cache_snapshot(), host=self.engine.tier_snapshot())
            if reply_to:
                self.proxies.send(reply_to, full)
            else:
                self.tell_manager(full)
        self.mailbox.call(answer)

"""Prometheus metrics: bucket boundaries, the labels every metric carries, and per-request phase timing.

Every llumnix metric carries ``model_name`` (``model.name``); an instance's metrics also carry
``instance_id`` (``instance.id``, or the one derived at start-up). Prometheus's own target label
``instance`` is left to Prometheus: no metric here uses it. Those labels are known only at run time, so
metrics are declared with ``counter``/``gauge``/``histogram`` below and each daemon calls ``bind`` once it
knows them; ``bind`` also creates the label-free series, so that they are exported (at 0) from the start.

Where vLLM exports the same quantity, the histogram has vLLM's bucket boundaries (vLLM 0.32,
vllm/v1/metrics/buckets.py) and a name that ends as vLLM's does, so that dashboards carry over:

    vllm:time_to_first_token_seconds           llumnix_proxy_time_to_first_token_seconds
    vllm:inter_token_latency_seconds           llumnix_proxy_inter_token_latency_seconds
    vllm:request_time_per_output_token_seconds llumnix_proxy_request_time_per_output_token_seconds
    vllm:e2e_request_latency_seconds           llumnix_proxy_e2e_request_latency_seconds
    vllm:prompt_tokens / generation_tokens     llumnix_proxy_prompt_tokens_total / _generation_tokens_total
    vllm:request_success{finished_reason}      llumnix_proxy_requests_finished_total{finished_reason}
    vllm:request_queue_time_seconds            llumnix_instance_request_queue_time_seconds
    vllm:request_prefill_time_seconds          llumnix_instance_request_prefill_time_seconds
    vllm:request_decode_time_seconds           llumnix_instance_request_decode_time_seconds
    vllm:num_preemptions                       llumnix_instance_preemptions_total
    vllm:kv_cache_usage_perc                   llumnix_instance_kv_cache_usage_perc (a ratio, 1 = full)
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterable, Iterator

from prometheus_client import Counter, Gauge, Histogram

# vLLM 0.32's boundaries (vllm/v1/metrics/buckets.py), in seconds.
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0)  # also time per output token
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)  # e2e, queue, prefill, decode

FINISHED_REASONS = ("stop", "length", "abort", "error")  # as vLLM's finished_reason (its "repetition" aside)

# The process labels, by daemon: which labels its metrics carry before their own.
_SCOPES = {"manager": ("model_name",), "proxy": ("model_name",), "instance": ("model_name", "instance_id")}
_bound: dict[str, str] = {"model_name": "", "instance_id": ""}
_all: list["Metric"] = []
_off = 0  # ``off()`` scopes open: while any is, every update does nothing


class _Off:
    """The series of every metric while ``off()``: counts nothing."""

    def labels(self, *values: str) -> "_Off":
        return self

    def inc(self, amount: float = 1) -> None:
        pass

    dec = set = observe = inc


_OFF = _Off()


class Metric:
    """A metric family whose process labels are filled in from ``bind``; used like a prometheus_client
    metric: ``m.inc()``, ``m.set(x)``, ``m.observe(x)``, ``m.labels(reason).inc()``, ``m.remove(value)``,
    where ``labels`` and ``remove`` take only the metric's own labels."""

    def __init__(self, cls, daemon: str, name: str, doc: str, labels: Iterable[str] = (),
                 preset: Iterable[tuple[str, ...]] = (), **kw):
        self.daemon = daemon
        self.scope = _SCOPES[daemon]
        self.own = tuple(labels)
        self.preset = [tuple(p) for p in preset]
        self.family = cls(name, doc, [*self.scope, *self.own], **kw)
        self._children: dict[tuple[str, ...], object] = {}
        _all.append(self)

    def labels(self, *values: str):
        if _off:
            return _OFF
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.family.labels(*(_bound[k] for k in self.scope), *values)
        return child

    def remove(self, *values: str) -> None:
        self._children.pop(values, None)
        try:
            self.family.remove(*(_bound[k] for k in self.scope), *values)
        except KeyError:
            pass

    def inc(self, amount: float = 1) -> None:
        self.labels().inc(amount)

    def dec(self, amount: float = 1) -> None:
        self.labels().dec(amount)

    def set(self, value: float) -> None:
        self.labels().set(value)

    def observe(self, value: float) -> None:
        self.labels().observe(value)


def counter(daemon: str, name: str, doc: str, labels: Iterable[str] = (), **kw) -> Metric:
    return Metric(Counter, daemon, name, doc, labels, **kw)


def gauge(daemon: str, name: str, doc: str, labels: Iterable[str] = (), **kw) -> Metric:
    return Metric(Gauge, daemon, name, doc, labels, **kw)


def histogram(daemon: str, name: str, doc: str, labels: Iterable[str] = (), *, buckets, **kw) -> Metric:
    return Metric(Histogram, daemon, name, doc, labels, buckets=buckets, **kw)


def bind(daemon: str, model_name: str, instance_id: str = "") -> None:
    """This process is ``daemon`` serving ``model_name`` (an instance: as ``instance_id``). Creates the series
    of ``daemon``'s metrics that have no labels of their own, and the preset ones, at 0."""
    _bound["model_name"] = model_name
    _bound["instance_id"] = instance_id
    for m in _all:
        m._children.clear()
        if m.daemon != daemon:
            continue
        if not m.own:
            m.labels()
        for values in m.preset:
            m.labels(*values)


def bound() -> dict[str, str]:
    return dict(_bound)


def counting() -> bool:
    """Whether metrics count (not within ``off()``): work done only for a gauge can be skipped when not."""
    return not _off


@contextmanager
def off() -> Iterator[None]:
    """Within: no metric counts anything (``llumnixctl simulate``: its many instances' daemon parts share one
    process, its figures are its own, and updating the series would cost it a good part of its time). What
    the daemons decide never reads a metric."""
    global _off
    _off += 1
    try:
        yield
    finally:
        _off -= 1


# ------------------------------------------------------------------------------ in several daemons
# A family that more than one daemon exports, declared once: each daemon's has its own name
# (llumnix_<daemon>_...) and, where it says whose, its own words.


def malformed_frames(daemon: str) -> Metric:
    return counter(daemon, f"llumnix_{daemon}_malformed_frames_total", "Frames dropped because they did not decode")


def disagg_decisions(daemon: str, which: str) -> Metric:
    """``which``: the dispatches it counts."""
    return counter(daemon, f"llumnix_{daemon}_disagg_decisions_total",
                   f"{which} while instances have roles, by where the request prefills: remote (on a prefill "
                   "instance, handed over at its first token), local_short, local_cached, local_prefill_busy (where "
                   "it will decode), no_prefill_pool, no_decode_pool", ["decision"])


def cache_dispatches(daemon: str) -> Metric:
    return counter(daemon, f"llumnix_{daemon}_cache_dispatches_total",
                   "llumnix-cache dispatches of requests cached somewhere, by what decided: cache (another instance "
                   "than llumnix would pick) or load (the same)", ["decided_by"], preset=[("cache",), ("load",)])


def prefix_index_blocks(daemon: str, whose: str) -> Metric:
    return gauge(daemon, f"llumnix_{daemon}_prefix_index_blocks",
                 f"Cached blocks in {whose} prefix index, summed over the instances that hold them")


def links_healed(daemon: str, timeout_setting: str, so: str) -> Metric:
    """``so``: what the healing spared."""
    return counter(daemon, f"llumnix_{daemon}_instance_links_healed_total",
                   f"Connections to instances dropped (no keepalive answered within {timeout_setting}) that a "
                   f"reconnection healed: {so}")


# ---------------------------------------------------------------------------------------------- proxy

P_REQUESTS = counter("proxy", "llumnix_proxy_requests_total", "HTTP API requests, by route and status",
                     ["route", "status"])
P_IN_FLIGHT = gauge("proxy", "llumnix_proxy_requests_in_flight", "Requests being served")
P_TTFT = histogram("proxy", "llumnix_proxy_time_to_first_token_seconds",
                   "From request arrival at the proxy to its first token (as vllm:time_to_first_token_seconds)",
                   buckets=TIME_TO_FIRST_TOKEN_BUCKETS)
P_ITL = histogram("proxy", "llumnix_proxy_inter_token_latency_seconds",
                  "Time between two deliveries of a sequence's tokens to the proxy, after the first: one observation "
                  "per delivery, as vLLM's one per engine step (as vllm:inter_token_latency_seconds)",
                  buckets=INTER_TOKEN_LATENCY_BUCKETS)
P_TPOT = histogram("proxy", "llumnix_proxy_request_time_per_output_token_seconds",
                   "Per sequence of 2 tokens or more: (last token - first token) / (output tokens - 1) "
                   "(as vllm:request_time_per_output_token_seconds)", buckets=INTER_TOKEN_LATENCY_BUCKETS)
P_E2E = histogram("proxy", "llumnix_proxy_e2e_request_latency_seconds",
                  "From request arrival to its end, across migrations and failovers "
                  "(as vllm:e2e_request_latency_seconds)", buckets=REQUEST_LATENCY_BUCKETS)
P_PROMPT_TOKENS = counter("proxy", "llumnix_proxy_prompt_tokens_total",
                          "Prompt tokens of requests that produced a first token (as vllm:prompt_tokens)")
P_GENERATION_TOKENS = counter("proxy", "llumnix_proxy_generation_tokens_total",
                              "Output tokens sent to clients (as vllm:generation_tokens)")
P_FINISHED = counter("proxy", "llumnix_proxy_requests_finished_total",
                     "Sequences (one per choice) that ended after the proxy placed them, by finished_reason: stop, "
                     "length, abort (the client went away), error (as vllm:request_success)", ["finished_reason"],
                     preset=[(r,) for r in FINISHED_REASONS])


class RequestTimer:
    """One request's latencies as the proxy sees them, end to end across migrations and failovers: its
    ``first_token``; each ``delivered`` batch of tokens of sequence (choice) ``k``; ``finished`` once, with
    each placed sequence's finish reason (later calls are ignored)."""

    __slots__ = ("arrival", "prompt_tokens", "first", "last", "tokens", "done", "now")

    def __init__(self, arrival: float, prompt_tokens: int, n: int = 1, now=time.perf_counter):
        """``now``: the clock ``arrival`` was read on (the proxy's Clock.monotonic; default perf_counter)."""
        self.now = now
        self.arrival = arrival
        self.prompt_tokens = prompt_tokens
        self.first = [0.0] * n
        self.last = [0.0] * n
        self.tokens = [0] * n
        self.done = False

    def first_token(self, at: float) -> None:
        P_TTFT.observe(at - self.arrival)
        P_PROMPT_TOKENS.inc(self.prompt_tokens)

    def delivered(self, k: int, n: int) -> None:
        now = self.now()
        if self.tokens[k]:
            P_ITL.observe(now - self.last[k])
        else:
            self.first[k] = now
        self.last[k] = now
        self.tokens[k] += n

    def finished(self, reasons: list[str | None]) -> None:
        """``reasons[k]``: how sequence k ended; None for one that was never placed (not counted)."""
        if self.done or not any(reasons):
            return
        self.done = True
        P_E2E.observe(self.now() - self.arrival)
        for k, reason in enumerate(reasons):
            if reason is None:
                continue
            if self.tokens[k] > 1:
                P_TPOT.observe((self.last[k] - self.first[k]) / (self.tokens[k] - 1))
            P_FINISHED.labels(reason).inc()


# ---------------------------------------------------------------------------------------------- instance

I_QUEUE = histogram("instance", "llumnix_instance_request_queue_time_seconds",
                    "From a request's admission on this instance to the start of the engine step that produced "
                    "its first token (as vllm:request_queue_time_seconds)", buckets=REQUEST_LATENCY_BUCKETS)
I_PREFILL = histogram("instance", "llumnix_instance_request_prefill_time_seconds",
                      "Duration of the engine step that produced a request's first token "
                      "(as vllm:request_prefill_time_seconds)", buckets=REQUEST_LATENCY_BUCKETS)
I_DECODE = histogram("instance", "llumnix_instance_request_decode_time_seconds",
                     "From a request's first token to its last, for requests that finished on the instance that "
                     "produced their first token (as vllm:request_decode_time_seconds)",
                     buckets=REQUEST_LATENCY_BUCKETS)


class RequestPhases:
    """An instance's per-request phase times (perf_counter): queue, prefill and decode. ``admitted`` when a
    proxy places a request here (a failover's re-prefill included; a migration's arrival is not: its first
    token was made elsewhere); ``outputs`` after each engine step; ``drop`` when a request leaves otherwise;
    ``prune`` keeps only the requests still held."""

    __slots__ = ("_admitted", "_first")

    def __init__(self):
        self._admitted: dict[str, float] = {}
        self._first: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._admitted) + len(self._first)

    def admitted(self, request_id: str) -> None:
        self._first.pop(request_id, None)
        self._admitted[request_id] = time.perf_counter()

    def outputs(self, outputs, step_start: float, step_s: float) -> None:
        """``outputs`` (TokenOuts) of the engine step that started at ``step_start`` and took ``step_s``."""
        if not self._admitted and not self._first:
            return
        now = time.perf_counter()
        admitted, first = self._admitted, self._first
        for out in outputs:
            rid = out.request_id
            t = admitted.pop(rid, None)
            if t is not None:
                I_QUEUE.observe(max(0.0, step_start - t))
                I_PREFILL.observe(step_s)
                if out.finish_reason is None:
                    first[rid] = now
                else:
                    I_DECODE.observe(0.0)
            elif out.finish_reason is not None:
                t = first.pop(rid, None)
                if t is not None:
                    I_DECODE.observe(now - t)

    def drop(self, request_id: str) -> None:
        self._admitted.pop(request_id, None)
        self._first.pop(request_id, None)

    def prune(self, held) -> None:
        """Forget requests not in ``held`` (they left by a path that did not ``drop`` them)."""
        for d in (self._admitted, self._first):
            for rid in [r for r in d if r not in held]:
                del d[rid]


class PreemptionCounter:
    """Turns the engine's monotonic preemption count into increments of a counter (a count that went down,
    as when a request that was preempted migrates away, moves the baseline without counting)."""

    __slots__ = ("metric", "last")

    def __init__(self, metric: Metric, start: int = 0):
        self.metric = metric
        self.last = start

    def update(self, preemptions: int) -> None:
        if preemptions > self.last:
            self.metric.inc(preemptions - self.last)
        self.last = preemptions

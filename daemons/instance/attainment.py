"""Attainment on an instance: each request with an SLO (wire.Submit's slo_ttft_ms, slo_tpot_ms, which the proxy set
from its class's [slo] targets and its API key) is judged where it finishes, against its targets, and the
judgements of the last ``slo.window_s`` are counted into the load report (wire.InstanceLoad slo_met, slo_judged)
and the instance's metrics; ``llumnixctl status`` shows them.

TTFT runs from the request's arrival at the proxy (wire.Submit.arrival_time, the proxy's wall clock) to its first
token going out here; TPOT from the first token to the last, per token after the first (the proxy's and vLLM's
definition). A request that migrates carries its targets and its first token's time and index
(wire.MigratingRequest), so the destination judges it with what the source measured. A failover's re-prefill is
not judged (its first token went out elsewhere, and nothing of it travelled); an aborted request neither."""

from __future__ import annotations

from collections import deque

from daemons import wire
from daemons.clock import Clock
from daemons.requests import SloMark

def judge(mark: SloMark, last_index: int, now: float) -> bool:
    """Whether a request that ended at ``now`` with its token ``last_index`` met both its targets."""
    if mark.ttft_s > 0 and mark.first_time - mark.arrival > mark.ttft_s:
        return False
    tokens = last_index - mark.first_index
    if mark.tpot_s > 0 and tokens > 0 and (now - mark.first_time) / tokens > mark.tpot_s:
        return False
    return True


class SloWindow:
    """Owns the judgements of the last ``window_s`` seconds (on ``clock``'s monotonic time). Verbs: ``add`` (one
    request judged), ``counts`` ((met, judged) over the window)."""

    def __init__(self, window_s: float, clock: Clock):
        self.window_s = window_s
        self.clock = clock
        self._judged: deque[tuple[float, bool]] = deque()
        self._met = 0

    def add(self, met: bool) -> None:
        self._evict()
        self._judged.append((self.clock.monotonic(), met))
        self._met += met

    def counts(self) -> tuple[int, int]:
        self._evict()
        return self._met, len(self._judged)

    def _evict(self) -> None:
        since = self.clock.monotonic() - self.window_s
        judged = self._judged
        while judged and judged[0][0] <= since:
            self._met -= judged.popleft()[1]


class ErrorWindow:
    """Owns the TTFT predictions' relative errors of the last ``window_s`` seconds. Verbs: ``add``, ``stats``
    ((median, 90th percentile, count) over the window)."""

    def __init__(self, window_s: float, clock: Clock):
        self.window_s = window_s
        self.clock = clock
        self._errors: deque[tuple[float, float]] = deque()
        self._stats: tuple[float, float, int] | None = (0.0, 0.0, 0)

    def add(self, error: float) -> None:
        self._evict()
        self._errors.append((self.clock.monotonic(), error))
        self._stats = None

    def stats(self) -> tuple[float, float, int]:
        self._evict()
        if self._stats is None:
            xs = sorted(e for _, e in self._errors)
            n = len(xs)
            self._stats = (xs[n // 2], xs[min(n - 1, int(0.9 * n))], n) if n else (0.0, 0.0, 0)
        return self._stats

    def _evict(self) -> None:
        since = self.clock.monotonic() - self.window_s
        errors = self._errors
        while errors and errors[0][0] <= since:
            errors.popleft()
            self._stats = None


class Attainment:
    """Judges the requests that finish here (``token``: each token of a request with an SLO, as it goes out) into
    its ``window``, and the TTFT the proxy predicted for each against the actual one at its first token into
    ``errors`` (|predicted - actual| / actual). Reads the wall clock (``clock.time()``: the proxy's arrival times
    are wall clock too)."""

    def __init__(self, window_s: float, clock: Clock):
        self.clock = clock
        self.window = SloWindow(window_s, clock)
        self.errors = ErrorWindow(window_s, clock)

    def token(self, mark: SloMark, out: wire.TokenOut) -> None:
        if not mark.first_time:
            mark.first_time = self.clock.time()
            mark.first_index = out.index
            actual = mark.first_time - mark.arrival
            if mark.predicted_ttft_s > 0 and actual > 0:
                self.errors.add(abs(mark.predicted_ttft_s - actual) / actual)
        if out.finish_reason is not None and out.finish_reason != "abort" and (mark.ttft_s > 0 or mark.tpot_s > 0):
            self.window.add(judge(mark, out.index, self.clock.time()))

    def counts(self) -> tuple[int, int]:
        """(met, judged) over the window."""
        return self.window.counts()

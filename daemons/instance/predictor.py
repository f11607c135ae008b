"""The instance's step-time model, learned online from its own steps (the SLO's predictions:
daemons/policy/slo.py), carried in every load report as wire.LatencyFit.

Each step's time is regressed on what the step did, in the form of the sim engine's latency model: [prefilled],
prefill tokens, [decoded], decoding requests, their context tokens. Sums of the regression decay with every step
(a half-life of ``half_life_steps``), so the model follows the machine as it changes (other work on the host, a
new model); a small ridge term keeps coefficients the steps say nothing about (no prefill seen yet) at zero
rather than wild, and a coefficient that comes out negative is dropped and the rest fitted again. No constant is
written per machine: an instance that has not stepped has no model, and nothing is predicted from it.
"""

from __future__ import annotations

import math

from daemons import wire
from daemons.instance.outlook import OutputLengths

# Features, scaled to about 1 for a typical step (the ridge term then treats them alike):
# [prefilled?, prefill tokens / 1k, decoded?, decoding requests / 64, context tokens / 64k].
_SCALE = (1.0, 1000.0, 1.0, 64.0, 65536.0)
_N = len(_SCALE)
_RIDGE = 1e-6
_MIN_STEPS = 8  # observations before the model is reported


def _solve(a: list[list[float]], b: list[float], active: list[int]) -> dict[int, float]:
    """Solve a[active][active] x = b[active] by Gaussian elimination with partial pivoting."""
    n = len(active)
    m = [[a[i][j] for j in active] + [b[i]] for i in active]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-12:
            continue
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c and m[r][c]:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return {active[i]: (m[i][n] / m[i][i] if abs(m[i][i]) >= 1e-12 else 0.0) for i in range(n)}


class StepFit:
    """Owns the decayed regression sums, the recent means (residual, finish rate) and the fitted coefficients.
    Verbs: ``stepped`` (one step: what it did and how long it took), ``finished`` (requests done), ``fit``
    (the model as of now, for the load report)."""

    def __init__(self, chunk_tokens: int = 0, half_life_steps: float = 500.0, rate_window_s: float = 10.0,
                 lengths: OutputLengths | None = None):
        self.chunk_tokens = chunk_tokens
        # The output lengths observed here (None: not kept, and the reports carry no outlook: [slo] off).
        self.lengths = lengths
        self.decay = 0.5 ** (1.0 / half_life_steps)
        self.rate_window_s = rate_window_s
        self.xtx = [[0.0] * _N for _ in range(_N)]
        self.xty = [0.0] * _N
        self.weight = 0.0
        self.steps = 0
        self.coef = [0.0] * _N  # milliseconds per scaled feature
        self._dirty = False
        self.extra_ms = 0.0
        self.finish_rate = 0.0
        self.decode_seen = 0  # the largest decode batch and prefill (tokens of one step) it has run
        self.prefill_seen = 0
        self._finished = 0
        self._rate_since: float | None = None

    def stepped(self, prefill_tokens: int, decodes: int, context_tokens: int, took_s: float) -> None:
        x = self._features(prefill_tokens, decodes, context_tokens)
        y = took_s * 1000.0
        d = self.decay
        for i in range(_N):
            xi = x[i]
            row = self.xtx[i]
            for j in range(_N):
                row[j] = row[j] * d + xi * x[j]
            self.xty[i] = self.xty[i] * d + xi * y
        self.weight = self.weight * d + 1.0
        self.steps += 1
        self.decode_seen = max(self.decode_seen, decodes)
        self.prefill_seen = max(self.prefill_seen, prefill_tokens)
        self._dirty = True
        if decodes > 0 and self.steps > _MIN_STEPS:
            residual = y - self._decode_part(decodes, context_tokens)
            self.extra_ms += 0.05 * (residual - self.extra_ms)

    def finished(self, count: int, now: float) -> None:
        """``count`` requests finished by ``now`` (called after every step, 0 included, so the rate falls when
        nothing finishes)."""
        if self._rate_since is None:
            self._rate_since = now
        self._finished += count
        span = now - self._rate_since
        if span >= self.rate_window_s / 4:
            rate = self._finished / span
            w = min(1.0, span / self.rate_window_s)
            self.finish_rate += w * (rate - self.finish_rate)
            self._finished, self._rate_since = 0, now

    def outputs(self, outputs: list[wire.TokenOut], now: float) -> None:
        """A step's outputs: the requests that finished (their number, and where kept, their lengths)."""
        ended = [o for o in outputs if o.finish_reason is not None]
        self.finished(len(ended), now)
        if self.lengths is not None:
            for o in ended:
                if o.finish_reason != "abort":
                    self.lengths.finished(o.index + 1, o.finish_reason == "stop")

    def fit(self) -> wire.LatencyFit | None:
        if self.steps < _MIN_STEPS:
            return None
        if self._dirty:
            self._refit()
        c = [k / s for k, s in zip(self.coef, _SCALE)]
        return wire.LatencyFit(self.steps, c[0], c[1], c[2], c[3], c[4], self.extra_ms, self.chunk_tokens,
                               self.finish_rate, self.decode_seen, self.prefill_seen)

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _features(prefill_tokens: int, decodes: int, context_tokens: int) -> list[float]:
        raw = (1.0 if prefill_tokens > 0 else 0.0, prefill_tokens, 1.0 if decodes > 0 else 0.0, decodes,
               context_tokens if decodes > 0 else 0)
        return [r / s for r, s in zip(raw, _SCALE)]

    def _decode_part(self, decodes: int, context_tokens: int) -> float:
        x = self._features(0, decodes, context_tokens)
        return sum(c * xi for c, xi in zip(self.coef, x))

    def _refit(self) -> None:
        """Ridge least squares over the decayed sums; coefficients that come out negative are pinned at 0."""
        ridge = _RIDGE * max(self.weight, 1.0)
        a = [[v + (ridge if i == j else 0.0) for j, v in enumerate(row)] for i, row in enumerate(self.xtx)]
        active = list(range(_N))
        coef = {}
        for _ in range(_N):
            coef = _solve(a, self.xty, active)
            negative = [i for i, v in coef.items() if v < 0 or math.isnan(v)]
            if not negative:
                break
            active = [i for i in active if i not in negative]
        self.coef = [max(coef.get(i, 0.0), 0.0) for i in range(_N)]
        self._dirty = False

"""Request traces made and reshaped in code: the paper's length mixes (power-law lengths fitted to the paper's
means within its bounds) and the transformations (``reindex``, ``scale_rate``, ``window``, ``limit``, ``clip``,
``with_priorities``, ``stats``) that ``llumnixctl trace`` and the figures apply to any trace.

The paper's mixes (Llumnix, OSDI'24, §6.1): input and output lengths from power-law distributions of
short (S), medium (M) and long (L) mean, 128, 256 and 512 tokens, named input-output, e.g. "S-L" is short
prompts with long outputs. The means are the paper's as remembered here; the bounds are not stated here
from the paper but chosen: ``PAPER_BOUNDS`` = [1, 6000] tokens per side, which for "L" gives a median of
~37 and a 99th percentile of ~5300 tokens, about the long tail of the paper's Table 1 as remembered (not
checked against the paper). The exponent for a mean is fitted exactly to the integer draws (``fit_alpha``).
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import replace
from typing import Iterable

from llumnixctl.experiments.traces import gen as trace
from llumnixctl.experiments.traces.gen import TraceRequest
from llumnixctl.stats import percentile

PAPER_MEANS = {"S": 128, "M": 256, "L": 512}
PAPER_BOUNDS = (1, 6000)


# ---------------------------------------------------------------------- the paper's mixes


def power_law_int_mean(lo: int, hi: int, alpha: float) -> float:
    """The exact mean of ``trace.power_law``'s integer draws: E[floor X] = lo + sum_{k>lo} P(X >= k)."""
    import numpy as np

    if lo < 1 or hi < lo:
        raise ValueError(f"power-law bounds must satisfy 1 <= lo <= hi; got [{lo}, {hi}]")
    a, b = float(lo), float(hi + 1)
    k = np.arange(lo + 1, hi + 1, dtype=np.float64)
    if abs(alpha - 1.0) < 1e-12:
        below = np.log(k / a) / math.log(b / a)  # P(X < k)
    else:
        e = 1.0 - alpha
        below = (k ** e - a ** e) / (b ** e - a ** e)
    return lo + float(np.sum(1.0 - below))


@functools.lru_cache(maxsize=256)
def fit_alpha(mean: float, lo: int, hi: int) -> float:
    """The exponent whose bounded power law on [lo, hi] has integer draws of mean ``mean`` (bisection)."""
    lo_a, hi_a = -30.0, 30.0  # the mean falls as alpha rises; these ends are near hi and near lo
    if not power_law_int_mean(lo, hi, hi_a) < mean < power_law_int_mean(lo, hi, lo_a):
        raise ValueError(f"no power law on [{lo}, {hi}] has mean {mean}: it must lie strictly between the bounds")
    for _ in range(100):
        mid = (lo_a + hi_a) / 2
        if power_law_int_mean(lo, hi, mid) > mean:
            lo_a = mid
        else:
            hi_a = mid
        if hi_a - lo_a < 1e-10:
            break
    return (lo_a + hi_a) / 2


def parse_mix(mix: str) -> tuple[int, int]:
    """"M-L" -> (256, 512): the mean prompt and output lengths of a paper mix (input-output)."""
    parts = mix.strip().upper().split("-")
    if len(parts) != 2 or any(p not in PAPER_MEANS for p in parts):
        names = ", ".join(f"{a}-{b}" for a in PAPER_MEANS for b in PAPER_MEANS)
        raise ValueError(f"unknown mix {mix!r}: give input-output lengths of S, M or L ({names})")
    return PAPER_MEANS[parts[0]], PAPER_MEANS[parts[1]]


def paper_trace(mix: str = "M-M", n: int = 1000, rate: float = 1.0, arrival: str = "gamma", cv: float = 2.0,
                high_fraction: float = 0.0, seed: int = 0, prompt_bounds: tuple[int, int] = PAPER_BOUNDS,
                output_bounds: tuple[int, int] = PAPER_BOUNDS) -> list[TraceRequest]:
    """A paper mix: power-law prompts and outputs of the mix's means within the bounds.

    Same seed, same streams as ``trace.generate``: only the exponents differ per side."""
    pmean, omean = parse_mix(mix)
    pa, oa = fit_alpha(pmean, *prompt_bounds), fit_alpha(omean, *output_bounds)
    kw = dict(rate=rate, arrival=arrival, cv=cv, prompt=prompt_bounds, output=output_bounds,
              high_fraction=high_fraction, seed=seed)
    prompts = trace.generate(n, alpha=pa, **kw)  # the streams are separate: a second call with the
    outputs = prompts if oa == pa else trace.generate(n, alpha=oa, **kw)  # output exponent gives the outputs
    return [replace(p, output_tokens=o.output_tokens) for p, o in zip(prompts, outputs)]


# ---------------------------------------------------------------------- transformations


def reindex(reqs: Iterable[TraceRequest]) -> list[TraceRequest]:
    return [r if r.index == i else replace(r, index=i) for i, r in enumerate(reqs)]


def by_arrival(reqs: list[TraceRequest]) -> list[TraceRequest]:
    """In arrival order, numbered again."""
    return reindex(sorted(reqs, key=lambda r: r.arrival_s))


def scale_rate(reqs: list[TraceRequest], factor: float) -> list[TraceRequest]:
    """Arrivals compressed by ``factor``: the rate times ``factor`` (2 = twice as fast)."""
    if not factor > 0 or math.isinf(factor):
        raise ValueError(f"the rate scale must be positive and finite; got {factor}")
    return reindex(replace(r, arrival_s=r.arrival_s / factor, think_s=r.think_s / factor) for r in reqs)


def window(reqs: list[TraceRequest], start_s: float = 0.0, end_s: float | None = None) -> list[TraceRequest]:
    """The requests arriving in [start_s, end_s), with ``start_s`` as the new 0."""
    if end_s is not None and end_s < start_s:
        raise ValueError(f"the window ends ({end_s}) before it starts ({start_s})")
    return reindex(replace(r, arrival_s=r.arrival_s - start_s) for r in reqs
                   if r.arrival_s >= start_s and (end_s is None or r.arrival_s < end_s))


def limit(reqs: list[TraceRequest], n: int) -> list[TraceRequest]:
    """The first ``n`` requests."""
    if n < 0:
        raise ValueError(f"the limit must be >= 0; got {n}")
    return reindex(reqs[:n])


def clip(reqs: list[TraceRequest], max_model_len: int, drop: bool = False) -> list[TraceRequest]:
    """Fit every request in a context of ``max_model_len`` tokens (prompt + output, at least 1 output token).

    Prompts are cut to ``max_model_len - 1`` and then outputs to what is left; with ``drop``, requests
    that do not fit are left out instead."""
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2; got {max_model_len}")
    out = []
    for r in reqs:
        if r.prompt_tokens + r.output_tokens <= max_model_len:
            out.append(r)
        elif not drop:
            p = min(r.prompt_tokens, max_model_len - 1)
            out.append(replace(r, prompt_tokens=p, output_tokens=min(r.output_tokens, max_model_len - p),
                               segments=cut_segments(r.segments, p)))
    return reindex(out)


def cut_segments(segments: tuple, tokens: int) -> tuple:
    """The leading ``tokens`` of a prompt's segments (a cut segment keeps its name: its tokens are a prefix
    of the whole one's)."""
    out, left = [], tokens
    for name, n in segments:
        if left <= 0:
            break
        out.append((name, min(n, left)))
        left -= n
    return tuple(out)


def with_priorities(reqs: list[TraceRequest], high_fraction: float, seed: int = 0) -> list[TraceRequest]:
    """Each request high priority with probability ``high_fraction``, else normal; the stream is
    ``trace.generate``'s, so a generated trace gets the priorities it would have had."""
    if not 0.0 <= high_fraction <= 1.0:
        raise ValueError(f"the high-priority fraction must be in [0, 1]; got {high_fraction}")
    rng = random.Random(f"llumnix-trace:{seed}:priority")
    return reindex(replace(r, priority="high" if rng.random() < high_fraction else "normal") for r in reqs)


def stats(reqs: list[TraceRequest]) -> dict:
    """``trace.summary`` plus min, percentiles and totals of the lengths and the high-priority share."""
    data = trace.summary(reqs)
    if not reqs:
        return data
    for key in ("prompt_tokens", "output_tokens"):
        xs = sorted(getattr(r, key) for r in reqs)
        data[key].update({"min": xs[0], "p90": percentile(xs, 90, "rank"), "p99": percentile(xs, 99, "rank"), "total": sum(xs)})
    data["first_arrival_s"] = reqs[0].arrival_s
    data["high_fraction"] = data["high_priority"] / len(reqs)
    return data

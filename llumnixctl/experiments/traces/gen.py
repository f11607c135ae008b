"""Generated request traces, like the Llumnix paper's: Poisson or Gamma arrivals, power-law lengths.

Pure and seeded: the same arguments give the same trace, on any machine (``random.Random`` seeded with a
string is stable across Python versions). Arrivals, prompt lengths, output lengths and priorities come from
separate random streams, so a Poisson and a Gamma trace of the same seed share their lengths and
priorities and differ only in when the requests arrive.

- Arrivals: a renewal process of rate ``rate`` (requests/s). Poisson: exponential gaps. Gamma: gaps of
  shape ``1 / cv**2`` and scale ``cv**2 / rate``, mean ``1 / rate`` and coefficient of variation ``cv``
  (``cv = 1`` is Poisson; ``cv > 1`` is burstier). The first request arrives one gap after 0.
- Lengths: a bounded power law, density proportional to ``x ** -alpha`` on ``[lo, hi + 1)``, rounded
  down to an integer in ``[lo, hi]``: most requests are short, a few are very long. ``alpha = 0`` is
  uniform; larger ``alpha`` is shorter on average with a heavier relative tail.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

ARRIVALS = ("poisson", "gamma")


@dataclass(frozen=True)
class TraceOptions:
    """What a generated trace is made of, with the generator's defaults: the one source of them. A command
    with other defaults names them in a TraceOptions of its own (llumnixctl/experiments/traces/options.py has
    the options' flags)."""

    requests: int = 1000
    rate: float = 1.0  # requests/s
    arrival: str = "poisson"
    cv: float = 1.0  # gamma arrivals: the gaps' coefficient of variation
    prompt_min: int = 16
    prompt_max: int = 512
    output_min: int = 16
    output_max: int = 1024
    alpha: float = 1.0  # the lengths' power-law exponent
    high_fraction: float = 0.0
    seed: int = 0


DEFAULT = TraceOptions()


@dataclass(frozen=True)
class TraceRequest:
    index: int
    arrival_s: float  # since the start of the trace
    prompt_tokens: int
    output_tokens: int
    priority: str  # "high" or "normal", as the API takes it
    # What the prompt says, for traces whose requests share content (cache.py): named segments of
    # tokens, (name, length), whose lengths add up to prompt_tokens; the same name is the same tokens in
    # every request. Empty: the prompt is the request's own (unique) content.
    segments: tuple = ()
    # Multi-turn conversations: the session's id (-1: none) and the turn's number in it. A turn after the
    # first is sent think_s after the previous turn of its session ended (a closed loop, as a chat user).
    session: int = -1
    turn: int = 0
    think_s: float = 0.0


def power_law(rng: random.Random, lo: int, hi: int, alpha: float) -> int:
    """One draw from the bounded power law on [lo, hi] (inverse CDF of the continuous density x^-alpha)."""
    if lo < 1 or hi < lo:
        raise ValueError(f"power-law bounds must satisfy 1 <= lo <= hi; got [{lo}, {hi}]")
    a, b, u = float(lo), float(hi + 1), rng.random()
    if abs(alpha - 1.0) < 1e-12:
        x = a * (b / a) ** u
    else:
        e = 1.0 - alpha
        x = (a ** e + u * (b ** e - a ** e)) ** (1.0 / e)
    return min(hi, max(lo, int(x)))


def power_law_mean(lo: int, hi: int, alpha: float) -> float:
    """The mean of the continuous density on [lo, hi + 1) (the integer draws' mean is about 0.5 lower)."""
    a, b = float(lo), float(hi + 1)

    def integral(p: float) -> float:  # integral of x^p over [a, b]
        return math.log(b / a) if abs(p + 1.0) < 1e-12 else (b ** (p + 1) - a ** (p + 1)) / (p + 1)

    return integral(1.0 - alpha) / integral(-alpha)


def gaps(rng: random.Random, n: int, rate: float, arrival: str, cv: float) -> list[float]:
    """``n`` inter-arrival times of mean ``1 / rate``."""
    if rate <= 0:
        raise ValueError(f"the arrival rate must be positive; got {rate}")
    if arrival == "poisson":
        return [rng.expovariate(rate) for _ in range(n)]
    if arrival == "gamma":
        if cv <= 0:
            raise ValueError(f"the coefficient of variation must be positive; got {cv}")
        shape = 1.0 / (cv * cv)
        return [rng.gammavariate(shape, 1.0 / (rate * shape)) for _ in range(n)]
    raise ValueError(f"unknown arrival process {arrival!r} (known: {', '.join(ARRIVALS)})")


def generate(n: int, *, rate: float, arrival: str = DEFAULT.arrival, cv: float = DEFAULT.cv,
             prompt: tuple[int, int] = (DEFAULT.prompt_min, DEFAULT.prompt_max),
             output: tuple[int, int] = (DEFAULT.output_min, DEFAULT.output_max), alpha: float = DEFAULT.alpha,
             high_fraction: float = DEFAULT.high_fraction, seed: int = DEFAULT.seed) -> list[TraceRequest]:
    """A trace of ``n`` requests in arrival order. ``prompt`` and ``output`` are inclusive length bounds."""
    if n < 0:
        raise ValueError(f"the number of requests must be >= 0; got {n}")
    if not 0.0 <= high_fraction <= 1.0:
        raise ValueError(f"the high-priority fraction must be in [0, 1]; got {high_fraction}")
    streams = {k: random.Random(f"llumnix-trace:{seed}:{k}") for k in ("arrival", "prompt", "output", "priority")}
    t = 0.0
    out = []
    for i, gap in enumerate(gaps(streams["arrival"], n, rate, arrival, cv)):
        t += gap
        out.append(TraceRequest(
            index=i, arrival_s=t,
            prompt_tokens=power_law(streams["prompt"], prompt[0], prompt[1], alpha),
            output_tokens=power_law(streams["output"], output[0], output[1], alpha),
            priority="high" if streams["priority"].random() < high_fraction else "normal",
        ))
    return out


def summary(trace: list[TraceRequest]) -> dict:
    """What a reader of the results wants to know about the trace."""
    if not trace:
        return {"requests": 0}
    p = sorted(r.prompt_tokens for r in trace)
    o = sorted(r.output_tokens for r in trace)
    return {
        "requests": len(trace), "duration_s": trace[-1].arrival_s,
        "offered_rate": len(trace) / trace[-1].arrival_s if trace[-1].arrival_s > 0 else None,
        "prompt_tokens": {"mean": sum(p) / len(p), "median": p[len(p) // 2], "max": p[-1]},
        "output_tokens": {"mean": sum(o) / len(o), "median": o[len(o) // 2], "max": o[-1]},
        "high_priority": sum(r.priority == "high" for r in trace),
    }

"""The one percentile of the toolkit's benches, figures, trace tools and scripts."""

from __future__ import annotations

import math
from typing import Iterable, Literal

Method = Literal["linear", "nearest", "rank"]


def percentile(xs: Iterable[float], q: float, method: Method = "linear", empty: float | None = 0.0) -> float | None:
    """The ``q``-th percentile (0-100) of ``xs``; ``empty`` when there are none.

    ``linear``: between the nearest two samples (numpy's and vLLM's default); ``nearest``: the sample at
    ``int(q/100 * n)`` (the benches' tail: never below the exact rank); ``rank``: the classic nearest rank,
    the sample at ``ceil(q/100 * n) - 1``."""
    ys = sorted(xs)
    n = len(ys)
    if not n:
        return empty
    if method == "linear":
        pos = (n - 1) * q / 100
        lo = math.floor(pos)
        hi = min(lo + 1, n - 1)
        return ys[lo] + (ys[hi] - ys[lo]) * (pos - lo)
    if method == "nearest":
        return ys[min(n - 1, int(q / 100 * n))]
    if method == "rank":
        return ys[max(0, min(n - 1, math.ceil(q / 100 * n) - 1))]
    raise ValueError(f"unknown percentile method {method!r}")

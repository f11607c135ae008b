"""Output lengths: how long a request's answer is expected to be, from a sample of observed lengths (an instance's
recent finishes: daemons/instance/outlook.py, or the quantiles of them its load report carries: wire.Outlook).
Pure functions over sorted lists of ints; a length known only as "at least" is wire.UNBOUNDED.
"""

from __future__ import annotations

import bisect

from daemons.wire import UNBOUNDED

QUANTILES = 16


def quantiles_of(sorted_lengths: list[int], k: int = QUANTILES) -> list[int]:
    """``k`` evenly spaced quantiles (the midpoints of k equal shares) of a sorted sample ([]: none)."""
    n = len(sorted_lengths)
    if not n:
        return []
    return [sorted_lengths[min(n - 1, int((i + 0.5) * n / k))] for i in range(k)]


def expected_output(sorted_lengths: list[int], generated: int, max_tokens: int, prefix: list[int] | None = None) -> int:
    """The mean of min(L, max_tokens) over the sample's lengths L > ``generated`` (UNBOUNDED counts as reaching
    ``max_tokens``); ``max_tokens`` when none got that far (it outlived them all: nothing bounds it but the cap).
    ``prefix``: the sample's prefix sums over bounded lengths (else computed here)."""
    m = max(max_tokens, generated + 1)
    lo = bisect.bisect_right(sorted_lengths, generated)
    n = len(sorted_lengths) - lo
    if n <= 0:
        return m
    cut = bisect.bisect_left(sorted_lengths, m)  # lengths >= m (UNBOUNDED among them) count as m
    below = (prefix or prefix_sums(sorted_lengths))
    below = below[cut] - below[lo]
    total = below + (len(sorted_lengths) - cut) * m
    return max(generated + 1, min(m, round(total / n)))


def prefix_sums(sorted_lengths: list[int]) -> list[int]:
    """Prefix sums of the bounded lengths (an UNBOUNDED one adds 0): ``expected_output``'s ``prefix``."""
    sums, total = [0], 0
    for v in sorted_lengths:
        total += v if v < UNBOUNDED else 0
        sums.append(total)
    return sums

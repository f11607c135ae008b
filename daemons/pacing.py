"""Pre-copy pacing from the engine's step times (``migration.max_decode_slowdown``).

A live migration's pre-copy competes with the engine for cores and memory bandwidth, so the requests
still decoding on the source slow down while it runs. The source times its engine's steps: those without
a migration make the baseline, those during pre-copy are compared with it, and the share of time the copy
may run (its *duty*) follows AIMD: halved when the recent steps are slower than the baseline by more than
the target, raised by a fixed amount when they are not. The copy thread runs a chunk, then rests so long
that its busy time is ``duty`` of the whole (daemons/kv/transfer.py), under ``migration.bandwidth_limit_mbps``
as the hard cap. The last stage is the request's downtime and is never paced.

Pure logic over plain numbers: no clocks, no threads (tests/unit/test_pacing.py).
"""

from __future__ import annotations

import statistics
from collections import deque

MIN_DUTY = 0.05  # the copy always progresses: at worst a twentieth of its unpaced speed
START_DUTY = 0.5  # before the first steps say anything
INCREASE = 0.05  # added to the duty per step within the target
DECREASE = 0.5  # the duty's factor per step over the target
RECENT = 3  # steps whose median is compared with the baseline (one slow step is noise)
BASELINE = 8  # quiet steps the baseline is the median of: the latest, for a step's time grows with the context
MIN_BASELINE = 4  # fewer quiet steps than this: no baseline, the duty stays where it starts


class Baseline:
    """The engine's step time without a migration: the median of the last quiet steps."""

    def __init__(self, size: int = BASELINE):
        self._steps: deque[float] = deque(maxlen=size)

    def add(self, step_s: float) -> None:
        if step_s > 0:
            self._steps.append(step_s)

    def value(self) -> float | None:
        """The median step time, or None with fewer than MIN_BASELINE steps."""
        return statistics.median(self._steps) if len(self._steps) >= MIN_BASELINE else None


class DutyPacer:
    """AIMD on one migration's copy duty (0 < duty <= 1) from its engine's steps during pre-copy."""

    def __init__(self, target: float, start: float = START_DUTY):
        self.target = target
        self.duty = min(1.0, max(MIN_DUTY, start))
        self._recent: deque[float] = deque(maxlen=RECENT)
        self.steps = 0  # steps judged
        self.over = 0  # of which over the target

    def step(self, step_s: float, baseline_s: float | None) -> float:
        """One engine step of ``step_s`` during pre-copy; returns the duty from now on."""
        if baseline_s is None or baseline_s <= 0 or step_s <= 0:
            return self.duty
        self._recent.append(step_s)
        slowdown = statistics.median(self._recent) / baseline_s - 1.0
        self.steps += 1
        if slowdown > self.target:
            self.over += 1
            self.duty = max(MIN_DUTY, self.duty * DECREASE)
        else:
            self.duty = min(1.0, self.duty + INCREASE)
        return self.duty


def rest_s(busy_s: float, duty: float) -> float:
    """How long the copy rests after ``busy_s`` of work so that work is ``duty`` of the time."""
    if duty >= 1.0 or busy_s <= 0:
        return 0.0
    return busy_s * (1.0 - duty) / max(duty, MIN_DUTY)

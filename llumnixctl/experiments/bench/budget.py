"""A benchmark's time budget and its progress line; and what every bench command shares besides: its flags
``--budget-s``, ``--json`` and ``--save`` (``BudgetOpt``, ``JsonOpt``, ``SaveOpt``) and its output (``emit``).

Every ``llumnixctl bench`` command takes ``--budget-s`` (default ``DEFAULT_BUDGET_S``; 0: none). The budget counts
from the command's start, cluster start-up included. Before each unit of work (a length, a round, a
configuration) the benchmark estimates what the unit will take from the units it has measured so far and skips
it when the estimate does not fit in what is left; the first unit always runs (nothing has been measured yet,
and a benchmark with no figure at all tells nobody anything). What was skipped, and why, is printed and goes
into ``--json`` as ``skipped`` (a list of objects, each naming the unit and a ``reason``), beside ``budget_s``.

The progress line goes to stderr (``--json`` keeps stdout to itself), one line per unit and a repeat of the
current line every ``heartbeat_s`` while a unit runs long::

    [3/12] length 4096, round 2: 41 s elapsed

Everything that decides is a pure function of measured durations and the clock (``estimate``, ``Budget``
with an injected clock): tests/unit/test_bench_budget.py.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Callable, Iterable, Optional, TextIO

import typer
from rich.console import Console

# 4 minutes: every benchmark's default run ends within 5 on 2 loaded cores, stopping its cluster included.
DEFAULT_BUDGET_S = 240.0
BUDGET_HELP = ("time budget of the whole run, seconds (0: none): units (lengths, rounds, configurations) whose "
               "estimate, from the ones measured so far, does not fit in what is left are skipped, and the output "
               "says which and why (--json: skipped); the first unit always runs")
STOP_RESERVE_S = 15.0  # what stopping a cluster and removing its scratch directory takes on a loaded machine


def budget_option() -> typer.models.OptionInfo:
    """``--budget-s`` (for ``Annotated[float, budget_option()] = DEFAULT_BUDGET_S``)."""
    return typer.Option("--budget-s", help=BUDGET_HELP, min=0.0)


BudgetOpt = Annotated[float, budget_option()]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON")]
SaveOpt = Annotated[Optional[Path], typer.Option(metavar="FILE", help="write the JSON here")]
# The peers' binaries (each from a venv of its own) and the model, for the benches that run vLLM engines.
SmgOpt = Annotated[Optional[str], typer.Option(help="the smg binary (pip install smg, in a venv of its own)")]
VllmRouterOpt = Annotated[Optional[str], typer.Option(help="the vllm-router binary (pip install vllm-router, in a venv of its own)")]
ModelOpt = Annotated[Optional[Path], typer.Option(metavar="DIR", help="checkpoint directory (default: a tiny random model)")]

SAFETY_SAME = 1.1  # a unit like one measured (a round, a load): rounds on a loaded machine vary by about that
SAFETY_LARGER = 1.2  # a longer unit than any measured: its power law is a guess too


def estimate(measured: Iterable[tuple[float, float]], size: float = 1.0, *,
             safety: float | None = None) -> float | None:
    """Seconds a unit of ``size`` should take, from units measured as (size, seconds); None when nothing was.

    Units of one size (rounds, repetitions): the longest measured. Units that grow (prompt lengths): the
    largest measured one scaled as a power of the size ratio, the power fitted to the two largest sizes and
    held between 1 (fixed costs make small units look flat: a length twice as long takes at least twice as
    long to prefill and to copy) and 2 (attention). Times ``safety`` (default: ``SAFETY_SAME``, or
    ``SAFETY_LARGER`` past the largest measured): a loaded machine's next unit is rarely faster."""
    pts: dict[float, float] = {}
    for s, t in measured:
        pts[float(s)] = max(pts.get(float(s), 0.0), float(t))
    if not pts:
        return None
    sizes = sorted(pts)
    top = sizes[-1]
    if size <= top:  # a unit no larger than one measured: the longest of those at least as large
        return max(t for s, t in pts.items() if s >= size) * (SAFETY_SAME if safety is None else safety)
    power = 1.0
    if len(sizes) >= 2:
        s0, s1 = sizes[-2], sizes[-1]
        if pts[s0] > 0 and pts[s1] > 0:
            power = min(2.0, max(1.0, math.log(pts[s1] / pts[s0]) / math.log(s1 / s0)))
    return pts[top] * (size / top) ** power * (SAFETY_LARGER if safety is None else safety)


def fmt_s(seconds: float) -> str:
    return f"{seconds:.0f} s"


class Budget:
    """What is left of ``budget_s`` (None or 0: no budget) since construction, and what was skipped."""

    def __init__(self, budget_s: float | None, *, clock: Callable[[], float] = time.monotonic,
                 start: float | None = None):
        self.budget_s = float(budget_s) if budget_s else None
        self.clock = clock
        self.t0 = clock() if start is None else start
        self.skipped: list[dict] = []
        self.ran = 0

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def left(self) -> float:
        return math.inf if self.budget_s is None else self.budget_s - self.elapsed()

    def allows(self, estimate_s: float | None, reserve_s: float = 0.0) -> bool:
        """Whether a unit estimated at ``estimate_s`` (None: not known, so it fits while ``reserve_s`` does)
        fits, keeping ``reserve_s`` for what must still run after it. The first unit always does."""
        if self.budget_s is None or self.ran == 0:
            return True
        return (estimate_s or 0.0) + reserve_s <= self.left()

    def reason(self, estimate_s: float | None, reserve_s: float = 0.0) -> str:
        left = max(0.0, self.left())
        why = "not estimated" if estimate_s is None else f"estimated {fmt_s(estimate_s)}"
        if reserve_s:
            why += f" (+{fmt_s(reserve_s)} for what follows)"
        return f"{why}, {fmt_s(left)} of the {fmt_s(self.budget_s or 0.0)} budget left"

    def consider(self, unit: dict, estimate_s: float | None, reserve_s: float = 0.0) -> bool:
        """True: run the unit (counted as run). False: it is recorded in ``skipped`` with the reason."""
        if self.allows(estimate_s, reserve_s):
            self.ran += 1
            return True
        self.skip(unit, self.reason(estimate_s, reserve_s))
        return False

    def always(self) -> None:
        """A unit that runs whatever is left (the one the others are compared with) counts as run."""
        self.ran += 1

    def skip(self, unit: dict, reason: str) -> dict:
        entry = {**unit, "reason": reason}
        self.skipped.append(entry)
        return entry

    def fields(self) -> dict:
        """What --json adds: ``budget_s`` (null: none) and ``skipped``."""
        return {"budget_s": self.budget_s, "skipped": list(self.skipped)}


MIN_SECONDS = 10.0


def fit_seconds(budget: Budget, seconds: float, reserve_s: float = 0.0, least: float = MIN_SECONDS) -> float:
    """A timed phase of ``seconds`` (an overload, a trace's length) shortened to what is left of the budget
    after ``reserve_s``, whole seconds, never below ``least`` (nor above ``seconds``)."""
    if budget.budget_s is None:
        return seconds
    room = math.floor(budget.left() - reserve_s)
    return float(min(seconds, max(least, room)))


def trace_prefix(arrivals: list[float], outputs: list[int], replays: int, room_s: float, step_s: float,
                 overhead_s: float) -> int:
    """How many requests of a trace (the first ones, in arrival order) ``replays`` replays of it fit in
    ``room_s``: each takes its last arrival, then the decoding of its longest output at ``step_s`` a token, and
    ``overhead_s`` (its cluster's start and stop). All of them when they fit; at least 1."""
    longest = 0
    best = 1
    for k, (at, out) in enumerate(zip(arrivals, outputs), start=1):
        longest = max(longest, out)
        if replays * (at + longest * step_s + overhead_s) > room_s:
            break
        best = k
    return best


def plan(units: list[tuple[dict, float]], durations: list[float], budget_s: float | None,
         start_s: float = 0.0) -> tuple[list[dict], list[dict]]:
    """Offline replay of ``Budget``: units as (unit, size) in run order, each one's measured duration when it
    runs, the time spent before the first (start-up). Returns (run, skipped), as a benchmark with estimates
    from ``estimate`` over the units of the same kind would decide. For tests and for a dry run's plan."""
    clock = [0.0]
    b = Budget(budget_s, clock=lambda: clock[0], start=0.0)
    clock[0] = start_s
    measured: list[tuple[float, float]] = []
    run, durations = [], list(durations)
    for unit, size in units:
        if b.consider(unit, estimate(measured, size)):
            d = durations.pop(0)
            clock[0] += d
            measured.append((size, d))
            run.append(unit)
    return run, b.skipped


class Progress:
    """``[i/n] label: N s elapsed`` lines on ``stream`` (stderr): one per ``step``, and the current one again
    every ``heartbeat_s`` (None: never) while nothing else is printed. ``elapsed`` counts from ``start`` (the
    budget's start, so both say the same)."""

    def __init__(self, total: int, *, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic,
                 start: float | None = None, heartbeat_s: float | None = 15.0):
        self.total = total
        self.stream = stream
        self.clock = clock
        self.t0 = clock() if start is None else start
        self.i = 0
        self.label = ""
        self.heartbeat_s = heartbeat_s
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._last = self.t0
        self._thread: threading.Thread | None = None

    def line(self, i: int | None = None, label: str | None = None) -> str:
        i = self.i if i is None else i
        label = self.label if label is None else label
        return f"[{i}/{self.total}] {label}: {self.clock() - self.t0:.0f} s elapsed"

    def _write(self, text: str) -> None:
        stream = self.stream or sys.stderr
        with self._lock:
            stream.write(text + "\n")
            stream.flush()
            self._last = self.clock()

    def step(self, label: str) -> str:
        """The next unit starts: ``[i+1/n] label: N s elapsed``."""
        self.i += 1
        self.label = label
        text = self.line()
        self._write(text)
        self._start_heartbeat()
        return text

    def update(self, label: str) -> str:
        """The same unit, a new part of it (``round 2``), or what runs between units (a cluster's start)."""
        self.label = label
        text = self.line()
        self._write(text)
        self._start_heartbeat()
        return text

    def skipped(self, label: str, reason: str) -> str:
        """The next unit is skipped: ``[i+1/n] label: skipped (reason)``."""
        self.i += 1
        self.label = ""  # nothing runs: no heartbeat repeats a unit that ended
        text = f"[{self.i}/{self.total}] {label}: skipped ({reason})"
        self._write(text)
        return text

    def _start_heartbeat(self) -> None:
        if self.heartbeat_s is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._beat, name="bench-progress", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._done.wait(min(1.0, self.heartbeat_s)):
            if self.clock() - self._last >= self.heartbeat_s and self.label:
                self._write(self.line())

    def close(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(2)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Units:
    """Units of one kind (rounds, configurations) under a budget, each estimated as the longest of that kind
    measured so far (``key``: the kind; None: all units alike), each with a progress line:

        units = Units(budget, progress)
        for ...:
            if not units.start({"round": 2, "system": "llumnix"}, "round 2/3: llumnix", key="llumnix"):
                continue
            ...
            units.done()
    """

    def __init__(self, budget: Budget, progress: Progress, reserve_s: float = STOP_RESERVE_S):
        self.budget, self.progress, self.reserve_s = budget, progress, reserve_s
        self.measured: dict[object, list[tuple[float, float]]] = {}
        self._current: tuple[object, float] | None = None

    def start(self, unit: dict, label: str, key: object = None) -> bool:
        est = estimate(self.measured.get(key, []) or [x for xs in self.measured.values() for x in xs])
        if not self.budget.consider(unit, est, self.reserve_s):
            self.progress.skipped(label, self.budget.skipped[-1]["reason"])
            return False
        self.progress.step(label)
        self._current = (key, self.budget.clock())
        return True

    def done(self) -> float:
        key, t0 = self._current
        seconds = self.budget.clock() - t0
        self.measured.setdefault(key, []).append((1.0, seconds))
        self._current = None
        return seconds


class Rounds:
    """Interleaved rounds of several systems (configurations) under a budget: a comparison needs every system of
    a round, so a later round runs whole or not at all: when the sum of its systems' estimates (each the longest
    of that system measured so far, or of any when it has none) fits in what is left, else each of its units is
    skipped, with a progress line each. In the first round, each unit after the first is weighed alone (a first
    round longer than the budget, as ``bench cache``'s, would otherwise have none):

        rounds = Rounds(budget, progress)
        for k in range(n):
            units = [({"round": k + 1, "system": s}, f"round {k + 1}/{n}: {s}", s) for s in systems]
            if not rounds.begin(units):
                continue
            for unit, label, key in units:
                if not rounds.start(unit, label, key):
                    continue
                ...
                rounds.done(key)
    """

    def __init__(self, budget: Budget, progress: Progress, reserve_s: float = STOP_RESERVE_S):
        self.budget, self.progress, self.reserve_s = budget, progress, reserve_s
        self.measured: dict[object, list[tuple[float, float]]] = {}
        self._t0 = 0.0
        self._round = 0

    def estimate(self, key: object) -> float | None:
        return estimate(self.measured.get(key, []) or [x for xs in self.measured.values() for x in xs])

    def begin(self, units: list[tuple[dict, str, object]]) -> bool:
        self._round += 1
        if self._round == 1:
            return True
        ests = [self.estimate(key) for _, _, key in units]
        total = None if any(e is None for e in ests) else sum(ests)
        if self.budget.allows(total, self.reserve_s):
            return True
        reason = "the round " + self.budget.reason(total, self.reserve_s)
        for unit, label, _ in units:
            self.budget.skip(unit, reason)
            self.progress.skipped(label, reason)
        return False

    def start(self, unit: dict, label: str, key: object) -> bool:
        """Whether the unit runs (its progress line is printed either way)."""
        if self._round == 1 and not self.budget.consider(unit, self.estimate(key), self.reserve_s):
            self.progress.skipped(label, self.budget.skipped[-1]["reason"])
            return False
        self.budget.always()
        self.progress.step(label)
        self._t0 = self.budget.clock()
        return True

    def done(self, key: object) -> float:
        seconds = self.budget.clock() - self._t0
        self.measured.setdefault(key, []).append((1.0, seconds))
        return seconds

    def interleaved(self, k: int, rounds: int, names: list[str], kind: str):
        """Round ``k`` (from 0) of ``rounds`` over ``names`` (the order reversed every other round: nobody always
        first), units keyed ``{"round": k + 1, kind: name}``: yields (label, name) of each unit that runs; it is
        timed until the caller asks for the next."""
        order = names if k % 2 == 0 else list(reversed(names))
        units = [({"round": k + 1, kind: s}, f"round {k + 1}/{rounds}: {s}", s) for s in order]
        if not self.begin(units):
            return
        for unit, label, name in units:
            if self.start(unit, label, name):
                yield label, name
                self.done(name)


def skipped_lines(skipped: list[dict], describe: Callable[[dict], str]) -> list[str]:
    """The human output's closing lines: one per skipped unit."""
    return [f"skipped {describe(s)}: {s['reason']}" for s in skipped]


def emit(res: dict, json_: bool, show: Callable[[dict], None], describe: Callable[[dict], str],
         save: Path | None = None) -> None:
    """A bench command's output: ``res`` written to ``save`` (--save, --out) if given, then printed as JSON
    (--json), or shown for people (``show``) with a closing line per skipped unit (``describe``: which)."""
    if save is not None:
        save.write_text(json.dumps(res, indent=2) + "\n")
    if json_:
        sys.stdout.write(json.dumps(res, indent=2) + "\n")
        return
    show(res)
    for line in skipped_lines(res.get("skipped", []), describe):
        Console().print(line, markup=False)

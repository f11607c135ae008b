"""The pure parts of ``llumnixctl bench disagg`` and ``bench handover``: the mixed trace (long prompts into
steady decode traffic), the figures of one run from the client's results and the clusters' counters, their
medians and ranges over rounds, the sanity checks against mixed serving, the tables, and the handover gap of
one stream. Nothing here starts a process or reads a clock.

Definitions (the client's, as ``bench serve``: vLLM's): TTFT from sending to the first chunk with a choice;
TPOT of a request (last - first) / (chunks - 1); ITL every gap between consecutive chunks (pooled). The decode
traffic is the ``short`` requests (short prompts, long outputs); the ``long`` ones are the long prompts (at least
10:1 input:output) whose prefill stalls everyone else's decoding on a mixed instance.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import asdict, dataclass

from rich.table import Table

from llumnixctl.experiments.bench.goodput import outcome, slo_figures, tpot_of
from llumnixctl.experiments.traces.gen import TraceRequest
from llumnixctl.stats import percentile

CONFIGS = ("mixed", "split", "adaptive")
KINDS = ("short", "long")
MIN_LONG_RATIO = 10  # a long prompt's input:output, at least
PHASES = ("queued", "prefill", "handover", "first_decode")
PHASE_METRIC = "llumnix_instance_request_phase_seconds"  # {phase}, where the instances have it
# Each phase's histograms, the first one with observations taken: the per-phase one, else the instances' own
PHASE_SOURCES = {"queued": ((PHASE_METRIC, "phase=queued"), ("llumnix_instance_request_queue_time_seconds", "")),
                 "prefill": ((PHASE_METRIC, "phase=prefill"), ("llumnix_instance_request_prefill_time_seconds", "")),
                 "handover": ((PHASE_METRIC, "phase=handover"), ("llumnix_instance_handover_seconds", "")),
                 "first_decode": ((PHASE_METRIC, "phase=first_decode"),)}
HANDOVERS_METRIC = "llumnix_instance_handovers_total"  # {reason, outcome}, on the prefill instances
HANDOVER_BYTES_METRIC = "llumnix_instance_handover_bytes"
GAP_METRIC = "llumnix_proxy_migration_gap_seconds"  # {kind}: the client's gap as the proxy sees it
DOWNTIME_METRIC = "llumnix_migration_downtime_seconds"
MIGRATION_METRIC = "llumnix_migration_seconds"
MIGRATIONS_METRIC = "llumnix_migrations_total"
DECISIONS_METRICS = ("llumnix_proxy_disagg_decisions_total", "llumnix_manager_disagg_decisions_total")
TPOT_GOAL_RATIO = 0.5  # the goal: P99 TPOT of the decode traffic disaggregated <= 1/2 of mixed serving's


def parse_lengths(text: str, what: str) -> tuple[int, int]:
    """``"2048:100"`` -> (2048, 100): prompt and output tokens. ValueError names ``what`` (the flag)."""
    try:
        prompt, output = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"{what} is PROMPT:OUTPUT tokens, e.g. 2048:100 (got {text!r})") from None
    if prompt < 1 or output < 1:
        raise ValueError(f"{what}: both lengths must be at least 1 (got {text!r})")
    return prompt, output


def parse_list(text: str, what: str, cast=int) -> list:
    try:
        out = [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} is a comma-separated list (got {text!r})") from None
    if not out:
        raise ValueError(f"{what} is empty")
    return out


@dataclass(frozen=True)
class Mix:
    """The trace: decode traffic (``short``) arriving steadily at ``short_rate``, long prompts (``long``) as
    Poisson arrivals at ``long_rate``, for ``seconds``. ``phase_s`` > 0: the mix shifts every ``phase_s`` seconds,
    from prompt-heavy (the phases from 0 on, even: every long prompt, at twice ``long_rate``, and half the decode
    traffic) to decode-heavy (odd: no long prompt, the decode traffic at 1.5 times its rate) and back; on average,
    the same rates as the stationary mix."""

    seconds: float = 30.0
    short_rate: float = 2.0
    short_prompt: int = 32
    short_output: int = 128
    long_rate: float = 0.5
    long_prompt: int = 2048
    long_output: int = 100
    seed: int = 0
    phase_s: float = 0.0

    def prompt_heavy(self, t: float) -> bool:
        return self.phase_s > 0 and int(t // self.phase_s) % 2 == 0

    def check(self) -> None:
        if self.long_prompt < MIN_LONG_RATIO * self.long_output:
            raise ValueError(f"a long prompt must be at least {MIN_LONG_RATIO}:1 input:output "
                             f"(got {self.long_prompt}:{self.long_output})")
        if self.short_prompt >= self.long_prompt:
            raise ValueError(f"the decode traffic's prompts ({self.short_prompt}) must be shorter than the long "
                             f"ones ({self.long_prompt})")
        if self.seconds <= 0 or self.short_rate <= 0 or self.long_rate < 0 or self.phase_s < 0:
            raise ValueError("--seconds and --decode-rate must be > 0, --long-rate and --phase-s >= 0")


def mixed_trace(mix: Mix, round_: int = 0) -> tuple[list[TraceRequest], list[str]]:
    """The requests in arrival order and each one's kind (by index). The decode traffic is evenly spaced (a
    steady load, its first at half a gap); the long prompts are Poisson, seeded by ``mix.seed`` and the round
    (every configuration of a round replays the same trace)."""
    rng = random.Random(f"disagg-{mix.seed}-{round_}")
    items = []

    def short_gap(at: float) -> float:
        factor = 1.0 if mix.phase_s <= 0 else 0.5 if mix.prompt_heavy(at) else 1.5
        return 1.0 / (mix.short_rate * factor)

    t = short_gap(0.0) / 2
    while t < mix.seconds:
        items.append((t, "short"))
        t += short_gap(t)
    t = 0.0
    long_rate = mix.long_rate * (2 if mix.phase_s > 0 else 1)
    while long_rate > 0:
        t += rng.expovariate(long_rate)
        if t >= mix.seconds:
            break
        if mix.phase_s <= 0 or mix.prompt_heavy(t):  # thinned: Poisson within the prompt-heavy phases
            items.append((t, "long"))
    items.sort()
    reqs, kinds = [], []
    for i, (at, kind) in enumerate(items):
        prompt, output = ((mix.short_prompt, mix.short_output) if kind == "short"
                          else (mix.long_prompt, mix.long_output))
        reqs.append(TraceRequest(i, round(at, 6), prompt, output, "normal"))
        kinds.append(kind)
    return reqs, kinds


def prompt_tokens(n: int, vocab: int, seed: str) -> list[int]:
    """``n`` token ids in [3, vocab), different for every ``seed`` (no prompt shares a prefix with another)."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


# ------------------------------------------------------------------ one run's figures


def _ms(xs: list[float], q: float) -> float | None:
    return round(percentile(xs, q) * 1000, 3) if xs else None


def kind_figures(results: list[dict], ttft_s: float, tpot_s: float) -> dict:
    """Requests, failures, TTFT and TPOT percentiles, ITL P99 and the longest gap (ms), attainment."""
    ok = [r for r in results if r["error"] is None and r["times"]]
    ttft = [r["times"][0] for r in ok]
    tpot = [t for t in (tpot_of(r) for r in ok) if t is not None]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    met = sum(outcome(r, ttft_s, tpot_s) == "met" for r in results)
    return {"requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
            "ttft_p50_ms": _ms(ttft, 50), "ttft_p99_ms": _ms(ttft, 99),
            "tpot_p50_ms": _ms(tpot, 50), "tpot_p99_ms": _ms(tpot, 99),
            "itl_p99_ms": _ms(itl, 99), "itl_max_ms": _ms(itl, 100),
            "met": met, "attainment": round(met / len(ok), 4) if ok else None}


def run_figures(results: list[dict], kinds: list[str], seconds: float, ttft_s: float, tpot_s: float) -> dict:
    """One run's client figures: per kind (``short``: the decode traffic, ``long``) and the SLO figures of all
    (goodput: requests that met both targets per second of the run)."""
    by = {k: [r for r in results if kinds[r["index"]] == k] for k in KINDS}
    return {"kinds": {k: kind_figures(rs, ttft_s, tpot_s) for k, rs in by.items() if rs},
            "failed": sum(1 for r in results if r["error"] is not None or not r["times"]),
            "slo": slo_figures(results, ttft_s, tpot_s, seconds),
            "errors": sorted({r["error"][:200] for r in results if r["error"]})[:5]}


# ------------------------------------------------------------------ the clusters' counters


IDENTITY_LABELS = ("instance_id", "model_name")  # who counted it: left out, so that a cluster's pages add up


def parse_metrics(text: str) -> dict[str, float]:
    """A Prometheus text page as {``name{k=v,...}``: value}, labels sorted, without the identity labels (and
    without the ``_created`` samples); samples with the same key summed."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            labels = sorted((k, v) for k, v in s.labels.items() if k not in IDENTITY_LABELS)
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in labels) + "}" if labels else "")
            out[key] = out.get(key, 0.0) + s.value
    return out


def merged(pages: list[dict[str, float]]) -> dict[str, float]:
    """Several pages' samples added up (the instances of a cluster)."""
    out: dict[str, float] = {}
    for page in pages:
        for k, v in page.items():
            out[k] = out.get(k, 0.0) + v
    return out


def delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def hist_mean_ms(before: dict[str, float], after: dict[str, float], name: str, labels: str = "") -> float | None:
    """The mean of a histogram's observations between two scrapes, ms (None with none). ``labels``:
    ``k=v`` pairs, sorted, as in parse_metrics's keys."""
    suffix = "{" + labels + "}" if labels else ""
    n = delta(before, after, f"{name}_count{suffix}")
    return round(delta(before, after, f"{name}_sum{suffix}") / n * 1000, 3) if n > 0 else None


def by_label(before: dict[str, float], after: dict[str, float], name: str, label: str) -> dict[str, float]:
    """A counter's increase per value of ``label`` (the other labels summed)."""
    out: dict[str, float] = {}
    for key in after:
        if key.startswith(name + "{"):
            labels = dict(p.split("=", 1) for p in key[len(name) + 1:-1].split(","))
            if label in labels:
                out[labels[label]] = out.get(labels[label], 0.0) + delta(before, after, key)
    return {k: v for k, v in sorted(out.items()) if v}


def by_labels(before: dict[str, float], after: dict[str, float], name: str, labels: tuple[str, ...]) -> dict[str, float]:
    """A counter's increase per combination of ``labels``, as "a/b" (e.g. reason/outcome)."""
    out: dict[str, float] = {}
    for key in after:
        if key.startswith(name + "{"):
            have = dict(p.split("=", 1) for p in key[len(name) + 1:-1].split(","))
            if all(k in have for k in labels):
                k = "/".join(have[x] for x in labels)
                out[k] = out.get(k, 0.0) + delta(before, after, key)
    return {k: int(v) for k, v in sorted(out.items()) if v}


def phase_mean_ms(before: dict[str, float], after: dict[str, float], phase: str) -> float | None:
    """A TTFT phase's mean, ms, from the first of its histograms (PHASE_SOURCES) that observed anything."""
    for name, labels in PHASE_SOURCES[phase]:
        mean = hist_mean_ms(before, after, name, labels)
        if mean is not None:
            return mean
    return None


def _scaled(x: float | None, k: float) -> float | None:
    return None if x is None else round(x * k, 3)


def cluster_figures(ordered_before: dict[str, int], ordered_after: dict[str, int], inst_before: dict[str, float],
                    inst_after: dict[str, float], proxy_before: dict[str, float], proxy_after: dict[str, float],
                    roles: dict[str, str]) -> dict:
    """What the cluster counted during a run: handovers committed and aborted (the manager's ordered migrations
    of reason "handover"), the other migrations by reason, the TTFT phases' means (the instances' phase
    histogram), the migrations' mean downtime, the dispatch decisions, the roles at the end."""
    ordered = {k: ordered_after.get(k, 0) - ordered_before.get(k, 0) for k in ordered_after}
    ordered = {k: v for k, v in sorted(ordered.items()) if v}
    phases = {p: phase_mean_ms(inst_before, inst_after, p) for p in PHASES}
    decisions: dict[str, float] = {}
    for name in DECISIONS_METRICS:
        for k, v in by_label(proxy_before, proxy_after, name, "decision").items():
            decisions[k] = decisions.get(k, 0) + v
    return {"handovers": {"committed": ordered.get("handover/committed", 0), "aborted": ordered.get("handover/aborted", 0)},
            "ordered_migrations": ordered,
            "migrations": by_label(inst_before, inst_after, MIGRATIONS_METRIC, "outcome"),
            "instance_handovers": by_labels(inst_before, inst_after, HANDOVERS_METRIC, ("reason", "outcome")),
            "phase_mean_ms": phases, "handover_ms": phases["handover"],
            "handover_gap_mean_ms": hist_mean_ms(proxy_before, proxy_after, GAP_METRIC, "kind=handover"),
            "handover_bytes_mean": _scaled(hist_mean_ms(inst_before, inst_after, HANDOVER_BYTES_METRIC), 1e-3),
            "migration_downtime_mean_ms": hist_mean_ms(inst_before, inst_after, DOWNTIME_METRIC),
            "migration_mean_ms": hist_mean_ms(inst_before, inst_after, MIGRATION_METRIC),
            "decisions": {k: int(v) for k, v in decisions.items()}, "roles_at_end": dict(sorted(roles.items()))}


# ------------------------------------------------------------------ rounds, sanity, tables

# The headline figures: (key in the summary, path in a run's figures, label in the table)
HEADLINES = (
    ("decode_tpot_p99_ms", ("kinds", "short", "tpot_p99_ms"), "decode traffic TPOT P99, ms"),
    ("decode_tpot_p50_ms", ("kinds", "short", "tpot_p50_ms"), "decode traffic TPOT P50, ms"),
    ("decode_itl_p99_ms", ("kinds", "short", "itl_p99_ms"), "decode traffic ITL P99, ms"),
    ("decode_itl_max_ms", ("kinds", "short", "itl_max_ms"), "decode traffic longest gap, ms"),
    ("short_ttft_p50_ms", ("kinds", "short", "ttft_p50_ms"), "short TTFT P50, ms"),
    ("short_ttft_p99_ms", ("kinds", "short", "ttft_p99_ms"), "short TTFT P99, ms"),
    ("long_ttft_p50_ms", ("kinds", "long", "ttft_p50_ms"), "long TTFT P50, ms"),
    ("long_ttft_p99_ms", ("kinds", "long", "ttft_p99_ms"), "long TTFT P99, ms"),
    ("goodput_rps", ("slo", "goodput_rps"), "goodput, met/s"),
    ("attainment", ("slo", "attainment"), "SLO attainment"),
    ("failed", ("failed",), "failed requests"),
    ("handovers_committed", ("cluster", "handovers", "committed"), "handovers committed"),
    ("handovers_aborted", ("cluster", "handovers", "aborted"), "handovers aborted"),
    ("handover_ms", ("cluster", "handover_ms"), "handover mean (order to commit), ms"),
    ("handover_gap_ms", ("cluster", "handover_gap_mean_ms"), "client's gap at handover (proxy), mean ms"),
    ("queued_ms", ("cluster", "phase_mean_ms", "queued"), "queued mean, ms"),
    ("prefill_ms", ("cluster", "phase_mean_ms", "prefill"), "prefill step mean, ms"),
    ("migration_downtime_ms", ("cluster", "migration_downtime_mean_ms"), "migration downtime mean, ms"),
    ("migration_ms", ("cluster", "migration_mean_ms"), "migration time mean, ms"),
)


def _get(d: dict, path: tuple):
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def spread(values: list) -> dict:
    """Median, min, max over the rounds of the values that exist (None where none does)."""
    xs = [v for v in values if v is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "values": values}
    return {"median": round(statistics.median(xs), 4), "min": min(xs), "max": max(xs), "values": values}


def summarize(runs: list[dict]) -> dict:
    """{config: {headline: spread over its rounds}} from the runs ({"config", "round", "figures"})."""
    out: dict[str, dict] = {}
    for cfg in dict.fromkeys(r["config"] for r in runs):
        mine = [r["figures"] for r in runs if r["config"] == cfg]
        out[cfg] = {key: spread([_get(f, path) for f in mine]) for key, path, _ in HEADLINES}
    return out


def _ratio(a, b):
    return round(a / b, 4) if a is not None and b else None


def sanity(summary: dict) -> dict:
    """Each configuration against ``mixed`` (medians over rounds): the decode traffic's P99 TPOT ratio (goal
    <= 1/2), the long prompts' TTFT increase against the handover time plus the queueing measured, goodput's
    ratio (goal > 1)."""
    base = summary.get("mixed")
    if base is None:
        return {}
    out = {}
    for cfg, s in summary.items():
        if cfg == "mixed":
            continue
        med = {k: v["median"] for k, v in s.items()}
        ratio = _ratio(med["decode_tpot_p99_ms"], base["decode_tpot_p99_ms"]["median"])
        increase = (None if med["long_ttft_p50_ms"] is None or base["long_ttft_p50_ms"]["median"] is None
                    else round(med["long_ttft_p50_ms"] - base["long_ttft_p50_ms"]["median"], 3))
        # the handover phase, else (no phase histogram) the migrations' mean time; plus the queueing
        handover = med["handover_ms"] if med["handover_ms"] is not None else med["migration_ms"]
        parts = [x for x in (handover, med["queued_ms"]) if x is not None]
        budget = round(sum(parts), 3) if parts else None  # None: the cluster measured neither
        good = _ratio(med["goodput_rps"], base["goodput_rps"]["median"])
        out[cfg] = {"tpot_p99_ratio": ratio, "tpot_goal_met": None if ratio is None else ratio <= TPOT_GOAL_RATIO,
                    "long_ttft_p50_increase_ms": increase, "handover_plus_queued_ms": budget,
                    "ttft_increase_within": None if increase is None or budget is None else increase <= budget,
                    "goodput_ratio": good, "goodput_higher": None if good is None else good > 1.0}
    return out


def with_summary(res: dict) -> dict:
    """A result with its runs' summary and sanity checks (recomputed)."""
    summary = summarize(res["runs"])
    return {**{k: v for k, v in res.items() if k not in ("summary", "sanity", "runs")},
            "summary": summary, "sanity": sanity(summary), "runs": res["runs"]}


MERGE_SAME = ("backend", "model", "instances", "prefill", "batch", "trace", "slo", "settings")


def merge_results(docs: list[dict]) -> dict:
    """Several results of the command (rounds split over runs, --first-round) as one: their runs in the order
    given, summarized again. ValueError when they differ in what makes them comparable, or repeat a round."""
    if not docs:
        raise ValueError("no file to merge")
    first = docs[0]
    for d in docs[1:]:
        for key in MERGE_SAME:
            if d.get(key) != first.get(key):
                raise ValueError(f"the files differ in {key!r}: {first.get(key)!r} vs {d.get(key)!r}")
    runs = [r for d in docs for r in d["runs"]]
    seen = [(r["config"], r["round"]) for r in runs]
    if len(set(seen)) != len(seen):
        raise ValueError("the files repeat a round of a configuration (give each run its own --first-round)")
    roles = {k: v for d in docs for k, v in d["roles"].items()}
    return with_summary({**first, "roles": roles, "rounds": len({r["round"] for r in runs}), "runs": runs})


def _cell(s: dict, digits: int) -> str:
    if s["median"] is None:
        return "-"
    f = f"{{:.{digits}f}}"
    if s["min"] == s["max"]:
        return f.format(s["median"])
    return f"{f.format(s['median'])} [{f.format(s['min'])}-{f.format(s['max'])}]"


def summary_table(result: dict) -> Table:
    """Rows: the headline figures; columns: the configurations; cells: median [min-max] over rounds."""
    t = Table(title=f"bench disagg: {result['instances']} {result['backend']} instances, {result['rounds']} rounds "
                    f"(median \\[min-max]); SLO TTFT {result['slo']['ttft_ms']:g} ms, TPOT {result['slo']['tpot_ms']:g} ms")
    t.add_column("figure")
    summary = result["summary"]
    for cfg in summary:
        t.add_column(f"{cfg} ({result['roles'][cfg]})", justify="right")
    for key, _, label in HEADLINES:
        digits = 3 if key in ("goodput_rps", "attainment") else 0 if key.startswith(("handovers", "failed")) else 1
        t.add_row(label, *(_cell(summary[c][key], digits) for c in summary))
    checks = result.get("sanity") or {}
    if checks:
        t.add_section()
    for cfg, c in checks.items():
        ok = {True: "yes", False: "NO", None: "-"}
        t.add_row(f"{cfg}: TPOT P99 / mixed (goal <= {TPOT_GOAL_RATIO:g})",
                  *(f"{c['tpot_p99_ratio']} ({ok[c['tpot_goal_met']]})" if col == cfg else "" for col in summary))
        t.add_row(f"{cfg}: long TTFT increase vs handover+queued, ms",
                  *(f"{c['long_ttft_p50_increase_ms']} vs {c['handover_plus_queued_ms']} ({ok[c['ttft_increase_within']]})"
                    if col == cfg else "" for col in summary))
        t.add_row(f"{cfg}: goodput / mixed (goal > 1)",
                  *(f"{c['goodput_ratio']} ({ok[c['goodput_higher']]})" if col == cfg else "" for col in summary))
    return t


def mix_dict(mix: Mix) -> dict:
    return asdict(mix)


# ------------------------------------------------------------------ bench handover: one stream's gap


def handover_gap(times: list[float]) -> dict:
    """A stream's token arrival times (s since sending): TTFT, the longest gap between two tokens after the first
    (the handover's, on a prefill instance) and where it fell (the token it preceded), the median gap (the decode
    step), in ms."""
    gaps = [b - a for a, b in zip(times, times[1:])]
    if not gaps:
        return {"ttft_ms": round(times[0] * 1000, 3) if times else None, "gap_ms": None, "gap_at": None,
                "step_ms": None}
    at = max(range(len(gaps)), key=gaps.__getitem__)
    return {"ttft_ms": round(times[0] * 1000, 3), "gap_ms": round(gaps[at] * 1000, 3), "gap_at": at + 1,
            "step_ms": round(statistics.median(gaps) * 1000, 3)}


def handover_rows(samples: list[dict]) -> list[dict]:
    """Per prompt length (samples: {"tokens", "cluster", "ttft_ms", "gap_ms", "step_ms", ...}), per cluster
    ("disagg" or "mixed"): the medians and ranges over repeats."""
    rows = []
    for n in dict.fromkeys(s["tokens"] for s in samples):
        row: dict = {"tokens": n}
        for cl in dict.fromkeys(s["cluster"] for s in samples):
            mine = [s for s in samples if s["tokens"] == n and s["cluster"] == cl]
            row[cl] = {k: spread([s.get(k) for s in mine])
                       for k in ("ttft_ms", "gap_ms", "proxy_gap_ms", "step_ms", "handover_ms", "migration_ms", "downtime_ms")}
            row[cl]["handovers"] = sum(s.get("handovers", 0) for s in mine)
            row[cl]["repeats"] = len(mine)
        rows.append(row)
    return rows


def handover_table(result: dict) -> Table:
    """Rows: prompt length x cluster (disagg: 1 prefill + 1 decode; mixed: one instance); cells: median
    [min-max] over the repeats, ms (gap: the client's; proxy gap: the proxy's own measure of the handover's)."""
    t = Table(title=f"bench handover: {result['backend']} ({result['model']}), {result['repeat']} requests per "
                    "length; gap = the client's longest wait between two tokens")
    for col in ("prompt", "cluster", "TTFT ms", "gap ms", "proxy gap ms", "step ms", "handover ms", "downtime ms",
                "handovers"):
        t.add_column(col, justify="left" if col == "cluster" else "right")
    for r in result["results"]:
        for c in ("disagg", "mixed"):
            if c in r:
                cells = [_cell(r[c][k], 1) for k in ("ttft_ms", "gap_ms", "proxy_gap_ms", "step_ms", "handover_ms",
                                                     "downtime_ms")]
                t.add_row(str(r["tokens"]), c, *cells, f"{r[c]['handovers']}/{r[c]['repeats']}")
    return t

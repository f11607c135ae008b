"""Goodput and attainment of benchmark results (llumnixctl/experiments/bench/goodput.py), as `bench overload` and
`bench serve` report them, on results built here."""

from __future__ import annotations

from llumnixctl.experiments.bench.goodput import high_refused_while_normal_admitted, outcome, slo_figures
from llumnixctl.experiments.bench.overload import analyse
from llumnixctl.experiments.bench.serve_figures import result_block


def ok(sent: float, ttft: float, tpot: float, tokens: int = 11, high: bool = False) -> dict:
    return {"sent": sent, "error": None, "status": 200, "high": high, "answered_s": ttft,
            "times": [ttft + i * tpot for i in range(tokens)]}


def refused(sent: float, high: bool = False, status: int = 429) -> dict:
    return {"sent": sent, "error": f"HTTP {status}", "status": status, "high": high, "answered_s": 0.002,
            "retry_after": "1", "times": []}


def test_each_request_gets_its_outcome_against_the_targets():
    assert outcome(ok(0, 0.5, 0.05), 1.0, 0.1) == "met"
    assert outcome(ok(0, 1.5, 0.05), 1.0, 0.1) == "missed_ttft"
    assert outcome(ok(0, 0.5, 0.2), 1.0, 0.1) == "missed_tpot"
    assert outcome(ok(0, 1.5, 0.2), 1.0, 0.1) == "missed_both"
    assert outcome(ok(0, 1.5, 0.2), 0.0, 0.0) == "met"  # no targets
    assert outcome(ok(0, 0.5, 9.0, tokens=1), 1.0, 0.1) == "met"  # one token: no TPOT
    assert outcome(refused(0), 1.0, 0.1) == "refused" and outcome(refused(0, status=503), 1.0, 0.1) == "refused"
    assert outcome({"error": "timeout after 600s", "times": []}, 1.0, 0.1) == "failed"
    late = refused(0) | {"error": 'HTTP 429: b\'{"error":{"message":"the request waited past its time-to-first-token '
                                  'target without starting'}
    assert outcome(late, 1.0, 0.1) == "gave_up"


def test_goodput_and_attainment_per_class():
    results = [ok(0.0, 0.5, 0.05), ok(0.1, 2.0, 0.05), ok(0.2, 0.5, 0.05, high=True), refused(0.3),
               refused(0.4, high=True), ok(0.5, 0.5, 0.5)]
    f = slo_figures(results, 1.0, 0.1, 10.0)
    normal, high = f["classes"]["normal"], f["classes"]["high"]
    assert (normal["requests"], normal["admitted"], normal["met"], normal["refused"]) == (4, 3, 1, 1)
    assert (normal["missed_ttft"], normal["missed_tpot"], normal["attainment"]) == (1, 1, 0.3333)
    assert (high["admitted"], high["met"], high["refused"], high["attainment"]) == (1, 1, 1, 1.0)
    assert f["goodput_rps"] == 0.2 and f["attainment"] == 0.5 and f["slo_ttft_ms"] == 1000


def test_a_high_refusal_counts_when_a_normal_request_was_admitted_in_the_same_moment():
    results = [refused(1.0, high=True), ok(1.05, 0.5, 0.05),  # the same moment: counts
               refused(5.0, high=True), ok(5.5, 0.5, 0.05), refused(5.02),  # admitted 0.5 s later: not the moment
               refused(9.0, high=True)]
    assert high_refused_while_normal_admitted(results) == 1


def test_overload_keeps_its_old_keys_and_adds_the_slo_figures():
    results = [ok(0.0, 0.5, 0.05), refused(0.01, high=True), ok(0.02, 0.4, 0.05, high=True)]
    late = refused(0.5) | {"answered_s": 2.0, "error": "HTTP 429: the request waited past its time-to-first-token target"}
    res = analyse(results + [late], [0.05, 0.06], 4.0, 40.0, 10.0, 1.0, 0.1)
    assert res["gave_up_429"] == 1 and res["gave_up_p50_ms"] == 2000 and res["refused_429"] == 2
    assert res["refusal_max_ms"] == 2.0  # the refusals at admission only
    for key in ("admitted", "refused_429", "refusal_p50_ms", "refusal_p99_ms", "admitted_ttft_p99_ms",
                "ttft_p99_ratio", "high_refused", "high_admitted", "normal_admitted"):
        assert key in res
    assert res["high_refused_while_normal_admitted"] == 1 and res["slo"]["goodput_rps"] == 0.2
    assert analyse(results, [0.05], 4.0, 40.0)["slo"] is None  # no targets: no SLO figures


def test_the_serve_result_block_shows_goodput_and_attainment():
    stats = {f"{s}_{k}_ms": 1.0 for s in ("mean", "median", "std", "p99") for k in ("ttft", "tpot", "itl", "e2el")}
    res = {"completed": 2, "failed": 0, "duration": 10.0, "total_input_tokens": 1, "total_output_tokens": 1,
           "request_throughput": 0.2, "output_throughput": 1.0, "total_token_throughput": 1.0, **stats,
           "prompt_token_mismatches": 0, "short_outputs": 0,
           "slo": slo_figures([ok(0, 0.5, 0.05), ok(1, 2.0, 0.05)], 1.0, 0.0, 10.0)}
    block = result_block(res)
    assert "Goodput (met requests/s):" in block and "0.10" in block
    assert "Attainment, normal (met/completed):" in block and "0.500 (1/2)" in block

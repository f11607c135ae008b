"""``llumnixctl bench sessions``' parts that need no engine: which settings each system runs with on this build,
what its client sends, the figures from the engines' counters, the perfect cache, the summary over rounds."""

from __future__ import annotations

from llumnixctl.experiments.bench import sessions as bench_sessions
from llumnixctl.experiments.traces import cache as tracecache, sessions as tsessions


def test_only_settings_this_build_declares_are_passed():
    assert bench_sessions.declared("manager.dispatch_policy")
    assert not bench_sessions.declared("manager.no_such_setting")
    assert not bench_sessions.declared("no_such_section.host_mb")
    for name in bench_sessions.OURS:
        sets, missing = bench_sessions.system_settings(name, 512)
        assert all(bench_sessions.declared(s.split("=")[0]) for s in sets)
        assert all(not bench_sessions.declared(s.split("=")[0]) for s in missing)
    # what each system asks for, declared or not: the tier off where it must be, on where it may be
    sessions = sum(bench_sessions.system_settings("llumnix-sessions", 512), [])
    assert "kv_tier.host_mb=512" in sessions and "kv_tier.pull=true" in sessions
    notier = sum(bench_sessions.system_settings("llumnix-notier", None), [])
    assert {"kv_tier.host_mb=0", "kv_tier.pull=false", "sessions.affinity=true"} <= set(notier)
    cache = sum(bench_sessions.system_settings("llumnix-cache", None), [])
    assert {"kv_tier.host_mb=0", "kv_tier.pull=false", "sessions.affinity=false"} <= set(cache)
    assert not any(s.startswith("kv_tier.host_mb") for s in sum(bench_sessions.system_settings("llumnix-sessions", None), []))


def test_each_system_client_names_the_session_as_its_router_reads_it():
    (req,) = [r for r in tsessions.sessions(2, session_rate=1.0, seed=5) if (r.session, r.turn) == (1, 1)]
    key = tsessions.session_key(5, 1)
    ours = bench_sessions.sender("llumnix-sessions", None, 5)
    body = ours.body(req)
    assert body["prompt_cache_key"] == key and ours.headers(req) == {bench_sessions.session_header(): key}
    assert body["prompt"] == tracecache.prompt_ids(req, 32000, 3) and len(body["prompt"]) == req.prompt_tokens
    assert body["max_tokens"] == req.output_tokens and body["ignore_eos"] and body["stream"]
    assert bench_sessions.sender("llumnix-notier", None, 5).body(req)["prompt_cache_key"] == key
    today = bench_sessions.sender("llumnix-cache", None, 5)
    assert "prompt_cache_key" not in today.body(req) and today.headers is None
    router = bench_sessions.sender("vllm-router", None, 5)
    assert router.headers(req) == {"x-session-id": key} and "prompt_cache_key" not in router.body(req)
    smg = bench_sessions.sender("smg", None, 5)
    assert smg.headers is None and "prompt_cache_key" not in smg.body(req)


def test_the_tally_counts_turns_per_engine_and_tokens_served_from_any_cache():
    vllm = [[("vllm:request_success_total", {"finished_reason": "length"}, 7.0),
             ("vllm:request_success_total", {"finished_reason": "stop"}, 1.0),
             ("vllm:prefix_cache_queries_total", {}, 1000.0), ("vllm:prefix_cache_hits_total", {}, 600.0),
             ("vllm:external_prefix_cache_hits_total", {}, 100.0)],
            [("vllm:request_success_total", {"finished_reason": "length"}, 2.0),
             ("vllm:prefix_cache_queries_total", {}, 500.0), ("vllm:prefix_cache_hits_total", {}, 100.0)]]
    t = bench_sessions.tally(vllm, [], ours=False)
    assert t["turns_by_instance"] == [8, 2] and t["busiest_over_fair"] == 1.6
    assert t["cache"] == {"prompt_tokens": 1500, "cached_tokens": 800, "by_source": None}
    # ours, before the tier: the prefix-cache counters
    before = [[("llumnix_instance_requests_total", {}, 5.0), (bench_sessions.OUR_QUERIED, {}, 900.0),
               (bench_sessions.OUR_HIT, {}, 450.0)]]
    assert bench_sessions.tally(before, [], ours=True)["cache"]["cached_tokens"] == 450
    # with the tier: engine, host and pulled tokens are cached, recomputed ones are not
    tiers = [[("llumnix_instance_requests_total", {}, 5.0), (bench_sessions.OUR_QUERIED, {}, 900.0),
              (bench_sessions.OUR_HIT, {}, 450.0)]
             + [(bench_sessions.OUR_SOURCES, {"source": s}, v) for s, v in
                (("engine", 400.0), ("host", 200.0), ("pulled", 50.0), ("recomputed", 250.0))]]
    proxy = [(bench_sessions.PROXY_SESSIONS, {"how": "affinity"}, 9.0), (bench_sessions.PROXY_SESSIONS, {"how": "new"}, 3.0)]
    t = bench_sessions.tally(tiers, proxy, ours=True)
    assert t["cache"]["cached_tokens"] == 650 and t["cache"]["by_source"]["recomputed"] == 250
    assert t["session_dispatches"] == {"affinity": 9, "new": 3}


def test_the_perfect_cache_counts_the_engines_lead_token_and_turns_per_second():
    reqs = tsessions.sessions(5, session_rate=1.0, seed=0)
    res = {"completed": 20, "duration_s": 10.0, "prompt_lead_tokens": 1,
           "cache": {"prompt_tokens": 1, "cached_tokens": 1000, "by_source": None}}
    out = bench_sessions.with_perfect(res, reqs, 128)
    perfect = tracecache.sharing(reqs, 128, 1)["shareable_tokens"]
    assert out["cache"]["perfect_tokens"] == perfect and out["cache"]["of_perfect"] == round(1000 / perfect, 4)
    assert out["turns_per_s"] == 2.0


def test_the_summary_gives_medians_and_ranges_over_rounds():
    rows = [{"system": "s", "p99_ttft_ms": x, "mean_ttft_ms": x / 2, "p50_ttft_ms": x / 3, "failed": f,
             "turns_per_s": 1.0, "busiest_over_fair": b, "cache": {"of_perfect": h}}
            for x, f, h, b in ((300, 0, .5, 1.1), (100, 1, .7, 1.3), (200, 0, .6, 1.2))]
    s = bench_sessions.summarize(rows)["s"]
    assert s["p99_ttft_ms"] == {"median": 200, "min": 100, "max": 300}
    assert s["of_perfect"]["median"] == .6 and s["busiest_over_fair"]["max"] == 1.3
    assert s["failed"] == 1 and s["rounds"] == 3

"""Metrics: daemons/metrics.py in-process, and a real Prometheus (Debian's prometheus package, with promtool)
scraping a running local cluster.

The shipped scripts/monitoring/ is checked here: the alert rules with `promtool check rules` and their unit
tests with `promtool test rules`; the example config with `promtool check config`; targets.py writes the
instances' targets; and every query of the Grafana dashboard returns data from this Prometheus once a few
requests (and one live migration) went through the cluster.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from llumnixctl.admin import AdminClient
from llumnixctl.lab.localcluster import free_port
from tests.streams import Stream, wait_for

pytestmark = pytest.mark.e2e

MONITORING = Path(__file__).resolve().parents[2] / "scripts" / "monitoring"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
MISSING = ("prometheus/promtool not installed: Debian's prometheus package (scripts/install.sh installs it when "
           "it runs as root where apt-get is)")


@pytest.fixture
def installed():
    """Skips where Prometheus is missing, except on CI, whose install step must have brought it."""
    if not (PROMETHEUS and PROMTOOL):
        if not os.environ.get("CI"):
            pytest.skip(MISSING)
        pytest.fail(MISSING)


# ---------------------------------------------------------------- daemons/metrics.py, in-process


def sample(name: str, **labels: str) -> float | None:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, {"model_name": "m", **labels})


class Out:
    def __init__(self, rid: str, finish_reason: str | None = None):
        self.request_id, self.finish_reason = rid, finish_reason


def test_bind_exports_a_daemons_series_with_its_labels():
    from daemons import metrics
    import daemons.instance  # noqa: F401  (declares the instance's metrics)
    import daemons.proxy.cluster.client  # noqa: F401

    metrics.bind("instance", "bind-test", "i7")
    assert sample("llumnix_instance_requests_total", model_name="bind-test", instance_id="i7") == 0
    assert sample("llumnix_instance_requests_finished_total", model_name="bind-test", instance_id="i7",
                  finished_reason="length") == 0
    assert sample("llumnix_migrations_total", model_name="bind-test", instance_id="i7", outcome="aborted") == 0
    assert sample("llumnix_instance_request_queue_time_seconds_bucket", model_name="bind-test", instance_id="i7",
                  le="0.3") == 0
    # Another daemon's metrics: not this process's.
    assert sample("llumnix_proxy_local_dispatches_total", model_name="bind-test") is None
    assert metrics.bound() == {"model_name": "bind-test", "instance_id": "i7"}


def test_instance_request_phases():
    from daemons import metrics

    metrics.bind("instance", "m", "i8")
    phases = metrics.RequestPhases()
    phases.admitted("a")
    phases.admitted("b")
    t = time.perf_counter()
    phases.outputs([Out("a"), Out("b", "length"), Out("migrated-in")], t, 0.05)  # b: one token only
    assert sample("llumnix_instance_request_queue_time_seconds_count", instance_id="i8") == 2
    assert sample("llumnix_instance_request_prefill_time_seconds_sum", instance_id="i8") == pytest.approx(0.1)
    assert sample("llumnix_instance_request_decode_time_seconds_count", instance_id="i8") == 1  # b, 0 s
    phases.outputs([Out("a"), Out("migrated-in", "stop")], t, 0.05)  # a decodes; one that came by migration: no
    assert sample("llumnix_instance_request_decode_time_seconds_count", instance_id="i8") == 1
    phases.outputs([Out("a", "stop")], t, 0.05)
    assert sample("llumnix_instance_request_decode_time_seconds_count", instance_id="i8") == 2
    assert sample("llumnix_instance_request_queue_time_seconds_count", instance_id="i8") == 2
    assert len(phases) == 0
    phases.admitted("c")
    phases.admitted("d")
    phases.drop("c")
    phases.prune(set())
    assert len(phases) == 0


def test_preemptions_count_the_engines_increments():
    from daemons import metrics

    metrics.bind("instance", "m", "i9")
    counter = metrics.PreemptionCounter(metrics.counter("instance", "test_preemptions", "for the test"), 0)
    for p in (2, 2, 1, 3):  # 1: a preempted request left (migrated): the baseline moves, nothing is counted
        counter.update(p)
    assert sample("test_preemptions_total", instance_id="i9") == 4


def test_proxy_request_timer():
    from daemons import metrics

    metrics.bind("proxy", "m")
    before = {k: sample(k) or 0 for k in ("llumnix_proxy_time_to_first_token_seconds_count",
                                           "llumnix_proxy_inter_token_latency_seconds_count",
                                           "llumnix_proxy_request_time_per_output_token_seconds_count",
                                           "llumnix_proxy_e2e_request_latency_seconds_count",
                                           "llumnix_proxy_prompt_tokens_total")}
    stop, abort = (sample("llumnix_proxy_requests_finished_total", finished_reason=r) for r in ("stop", "abort"))
    timer = metrics.RequestTimer(time.perf_counter(), prompt_tokens=5, n=3)
    timer.first_token(time.perf_counter())
    timer.delivered(0, 1)
    timer.delivered(0, 3)  # one delivery of three tokens: one inter-token latency
    timer.delivered(1, 1)
    timer.finished(["stop", "abort", None])  # choice 2 was never placed
    timer.finished(["stop", "stop", "stop"])  # once
    assert sample("llumnix_proxy_time_to_first_token_seconds_count") == before["llumnix_proxy_time_to_first_token_seconds_count"] + 1
    assert sample("llumnix_proxy_prompt_tokens_total") == before["llumnix_proxy_prompt_tokens_total"] + 5
    assert sample("llumnix_proxy_inter_token_latency_seconds_count") == before["llumnix_proxy_inter_token_latency_seconds_count"] + 1
    assert (sample("llumnix_proxy_request_time_per_output_token_seconds_count")
            == before["llumnix_proxy_request_time_per_output_token_seconds_count"] + 1)  # choice 0 only: 4 tokens
    assert sample("llumnix_proxy_e2e_request_latency_seconds_count") == before["llumnix_proxy_e2e_request_latency_seconds_count"] + 1
    assert sample("llumnix_proxy_requests_finished_total", finished_reason="stop") == stop + 1
    assert sample("llumnix_proxy_requests_finished_total", finished_reason="abort") == abort + 1


def test_vllm_bucket_boundaries():
    from daemons import metrics

    spec = importlib.util.find_spec("vllm")  # read, not imported (importing vLLM takes seconds)
    path = spec and Path(spec.origin).parent / "v1" / "metrics" / "buckets.py"
    if not path or not path.exists():
        pytest.skip("vllm is not installed")
    theirs = {t.id: ast.literal_eval(node.value) for node in ast.parse(path.read_text()).body
              if isinstance(node, ast.AnnAssign | ast.Assign)
              for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)
              and t.id.endswith("_BUCKETS") and isinstance(node.value, ast.Tuple)}
    for name in ("TIME_TO_FIRST_TOKEN_BUCKETS", "INTER_TOKEN_LATENCY_BUCKETS", "REQUEST_LATENCY_BUCKETS"):
        assert getattr(metrics, name) == tuple(theirs[name]), name


# ---------------------------------------------------------------- shipped monitoring files

MODEL = "llumnix-sim"
BODY = {"model": MODEL, "prompt": "hello " * 8, "max_tokens": 12, "ignore_eos": True}


def promtool(*args: str, cwd: Path = MONITORING) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_alert_rules_check_and_pass_their_unit_tests(installed):
    res = promtool("check", "rules", "llumnix-alerts.yml")
    assert res.returncode == 0 and "SUCCESS: 7 rules found" in res.stdout, res.stdout + res.stderr
    res = promtool("test", "rules", "llumnix-alerts.test.yml")
    assert res.returncode == 0 and "SUCCESS" in res.stdout, res.stdout + res.stderr


def test_example_config_checks(installed):
    res = promtool("check", "config", "prometheus.yml")
    assert res.returncode == 0, res.stdout + res.stderr


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads((MONITORING / "llumnix-dashboard.json").read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def concrete(expr: str) -> str:
    """A dashboard query as Grafana sends it with every variable at All (allValue .*)."""
    return (expr.replace("$__rate_interval", "1m").replace("$model_name", ".*").replace("$instance_id", ".*"))


def test_dashboard_is_complete():
    dash = json.loads((MONITORING / "llumnix-dashboard.json").read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    assert not [e for _, e in exprs if "$" in concrete(e)], "a variable the test does not know"
    used = set(re.findall(r"\b(llumnix_[a-z0-9_]+)", " ".join(e for _, e in exprs)))
    for name in ("llumnix_proxy_time_to_first_token_seconds_bucket", "llumnix_proxy_inter_token_latency_seconds_bucket",
                 "llumnix_proxy_request_time_per_output_token_seconds_bucket",
                 "llumnix_proxy_e2e_request_latency_seconds_bucket", "llumnix_instance_request_queue_time_seconds_bucket",
                 "llumnix_instance_request_prefill_time_seconds_bucket",
                 "llumnix_instance_request_decode_time_seconds_bucket", "llumnix_instance_kv_cache_usage_perc",
                 "llumnix_instance_preemptions_total", "llumnix_proxy_prompt_tokens_total",
                 "llumnix_proxy_generation_tokens_total", "llumnix_proxy_requests_finished_total",
                 "llumnix_migration_downtime_seconds_bucket", "llumnix_migration_bytes_total",
                 "llumnix_proxy_slo_requests_total", "llumnix_instance_slo_attainment",
                 "llumnix_instance_slo_met_requests", "llumnix_instance_slo_judged_requests",
                 "llumnix_instance_predicted_ttft_seconds", "llumnix_instance_predicted_tpot_seconds",
                 "llumnix_proxy_ttft_actual_over_predicted_bucket", "llumnix_proxy_tpot_actual_over_predicted_bucket",
                 # Sessions and KV tiers (issue #52)
                 "llumnix_proxy_session_dispatches_total", "llumnix_proxy_sessions", "llumnix_prefix_tokens_total",
                 "llumnix_kv_tier_blocks", "llumnix_kv_tier_capacity_blocks", "llumnix_kv_retained_blocks",
                 "llumnix_kv_restored_bytes_total", "llumnix_kv_restore_seconds_bucket", "llumnix_kv_pulls_total",
                 "llumnix_kv_pulled_bytes_total", "llumnix_kv_pull_seconds_bucket", "llumnix_sessions_rehomed_total"):
        assert name in used, name


# ---------------------------------------------------------------- a Prometheus scraping a cluster


class Prom:
    def __init__(self, url: str):
        self.url = url

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", f"{expr}: {r.status_code} {body}"
        return body["data"]["result"]

    def value(self, expr: str) -> float:
        """The single value of ``expr``; 0 if it has no result."""
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else 0.0


def manager_metrics_address(c) -> str:
    line = next(x for x in open(c.proc("manager").log) if "metrics 127.0.0.1:" in x)
    return re.search(r"metrics (127\.0\.0\.1:\d+)", line).group(1)


@pytest.fixture
def prometheus(tmp_path, installed):
    """start(config_text) -> Prom: a Prometheus on a free loopback port, data under tmp_path, stopped by pid."""
    procs: list[subprocess.Popen] = []

    def start(config: str) -> Prom:
        (tmp_path / "prometheus.yml").write_text(config)
        port = free_port()
        log = open(tmp_path / "prometheus.log", "w")
        procs.append(subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path))
        prom = Prom(f"http://127.0.0.1:{port}")

        def ready() -> bool:
            assert procs[-1].poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            try:
                return httpx.get(prom.url + "/-/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 30, "Prometheus did not get ready", every=0.2)
        return prom

    try:
        yield start
    finally:
        for p in procs:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def test_prometheus_scrapes_the_cluster_and_every_dashboard_query_has_data(start_cluster, prometheus, tmp_path):
    # With SLO targets no request here misses (a minute to the first token, 10 s per token): the SLO panels have data.
    # A LoRA adapter (the sim loads any path) and one request for it: the LoRA panels have data.
    c = start_cluster(2, ["instance.min_step_s=0.01", "slo.ttft_ms=60000", "slo.tpot_ms=10000", "lora.slots=2",
                          "lora.adapters=sql=/adapters/sql"])
    # The instances' targets as an operator gets them: scripts/monitoring/targets.py (file_sd).
    targets = tmp_path / "llumnix-instances.json"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    res = subprocess.run([sys.executable, str(MONITORING / "targets.py"), str(targets), "--", "--run-dir", str(c.run_dir)],
                         capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    assert len(json.loads(targets.read_text())[0]["targets"]) == 2
    proxy = c.url.removeprefix("http://")
    prom = prometheus(f"""
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:
  - {MONITORING / 'llumnix-alerts.yml'}
scrape_configs:
  - job_name: llumnix-manager
    static_configs: [{{targets: ["{manager_metrics_address(c)}"]}}]
  - job_name: llumnix-proxy
    static_configs: [{{targets: ["{proxy}"]}}]
  - job_name: llumnix-instance
    file_sd_configs: [{{files: ["{targets}"], refresh_interval: 5s}}]
""")
    wait_for(lambda: prom.value('count(up{job=~"llumnix-.*"} == 1)') == 4, 30, "not every target is up", every=0.5)

    # Traffic: plain and streamed completions, a chat, and one request live-migrated mid-stream.
    n = 0
    with httpx.Client(base_url=c.url, timeout=60) as http:
        for i in range(6):
            r = http.post("/v1/completions", json=BODY | ({"stream": True} if i % 2 else {}))
            assert r.status_code == 200, r.text
            n += 1
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 8, "ignore_eos": True})
        assert r.status_code == 200, r.text
        n += 1
        r = http.post("/v1/completions", json=BODY | {"model": "sql"})
        assert r.status_code == 200 and r.json()["model"] == "sql", r.text
        n += 1
    s = Stream(c.url, 300, prompt="move me " * 20, ignore_eos=True)
    s.wait_tokens(5)
    admin = AdminClient(c.manager, timeout_s=30)
    try:
        src = next(r.instance_id for r in admin.requests().requests if r.request_id == s.rid)
        outcome = admin.migrate("i1" if src == "i0" else "i0", request_id=s.rid).outcomes[0]
    finally:
        admin.close()
    assert outcome.outcome == "committed", outcome
    s.result(60)
    assert s.error is None and len(s.ids) == 300
    n += 1

    # Prometheus has what the daemons counted once its scrapes caught up.
    finished = f'sum(llumnix_proxy_requests_finished_total{{model_name="{MODEL}", finished_reason="length"}})'
    wait_for(lambda: prom.value(finished) >= n, 30, f"Prometheus did not see {n} finished requests", every=0.5)
    # The instances are other targets, scraped at other moments: wait for their counts too (under load their
    # scrape can come a second after the proxy's; asserting at once failed in CI).
    wait_for(lambda: prom.value("sum(llumnix_instance_generation_tokens_total)") >= 6 * 12 + 8 + 300
             and prom.value("sum(llumnix_instance_request_prefill_time_seconds_count)") >= n
             and prom.value("sum(llumnix_instance_request_decode_time_seconds_count)") >= n - 1, 30,
             "Prometheus did not see the instances' counts", every=0.5)
    for hist in ("llumnix_proxy_time_to_first_token_seconds", "llumnix_proxy_e2e_request_latency_seconds",
                 "llumnix_proxy_request_time_per_output_token_seconds", "llumnix_instance_request_queue_time_seconds",
                 "llumnix_instance_request_prefill_time_seconds"):
        assert prom.value(f"sum({hist}_count)") >= n, hist
        assert prom.value(f'sum({hist}_bucket{{le="+Inf"}})') >= n, hist
        assert len(prom.query(f"{hist}_bucket")) >= 10, hist  # vLLM's boundaries, per series
    assert prom.value("sum(llumnix_proxy_inter_token_latency_seconds_count)") >= 50
    assert prom.value("sum(llumnix_instance_request_decode_time_seconds_count)") >= n - 1  # the migrated one aside
    assert prom.value('sum(llumnix_proxy_time_to_first_token_seconds_bucket{le="2560.0"})') >= n  # vLLM's last bound
    assert prom.value("sum(llumnix_proxy_prompt_tokens_total)") >= 6 * 8
    assert prom.value("sum(llumnix_proxy_generation_tokens_total)") >= 6 * 12 + 8 + 300
    assert prom.value("sum(llumnix_instance_generation_tokens_total)") >= 6 * 12 + 8 + 300
    # SLO: every request met its targets, as the proxy counts them and as the instances that finished them judge.
    assert prom.value('sum(llumnix_proxy_slo_requests_total{outcome="met"})') >= n
    assert prom.value('sum(llumnix_proxy_slo_requests_total{outcome!="met"})') == 0
    wait_for(lambda: prom.value("sum(llumnix_instance_slo_judged_requests)") >= n, 30,
             "Prometheus did not see the instances' SLO judgements", every=0.5)
    assert prom.value("sum(llumnix_instance_slo_met_requests)") == prom.value("sum(llumnix_instance_slo_judged_requests)")
    assert prom.value("min(llumnix_instance_predicted_tpot_seconds)") > 0
    assert prom.value('sum(llumnix_migrations_total{outcome="committed"})') >= 1
    assert prom.value("sum(llumnix_migration_downtime_seconds_count)") >= 1
    assert prom.value('sum(llumnix_migration_bytes_total{direction="out"})') > 0
    assert len(prom.query('llumnix_instance_preemptions_total{instance_id=~"i0|i1"}')) == 2
    assert len(prom.query("llumnix_instance_kv_cache_usage_perc")) == 2
    # Labels: model_name on every llumnix series, instance_id on every instance's; nothing collides with
    # Prometheus's own instance label; the manager no longer repeats the instance's own gauges.
    assert prom.query('count({__name__=~"llumnix_.+", model_name!="llumnix-sim"})') == []
    assert prom.query('count({__name__=~"llumnix_.+", job="llumnix-instance", instance_id!~"i0|i1"})') == []
    assert prom.query('count({__name__=~"llumnix_.+", exported_instance!=""})') == []
    assert len(prom.query("llumnix_instance_freeness")) == 2
    assert prom.query('{__name__=~"llumnix_instance_(blocks_used|running|waiting)"}') == []

    # Every query of the dashboard returns data; the latency panels, numbers.
    exprs = dashboard_exprs()

    def empty() -> list[str]:
        return [f"{title}: {expr}" for title, expr in exprs if not prom.query(concrete(expr))]

    deadline = time.monotonic() + 60  # a rate needs two scrapes of a series in its window: wait for the next ones
    while (missing := empty()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not missing, "\n".join(missing)
    for title, expr in exprs:
        # (Refusal time has no observation on a healthy cluster, nothing being refused: its query has series, and
        # tests/unit/test_slo_outlook.py checks what a refusal observes.)
        if "histogram_quantile(0.99" in expr and "proxy" in expr and "refusal_seconds" not in expr:
            values = [float(r["value"][1]) for r in prom.query(concrete(expr))]
            assert any(math.isfinite(v) and v > 0 for v in values), f"{title}: {expr}: {values}"
    # And the alert rules load and evaluate against live data (none fires on a healthy cluster).
    rules = httpx.get(prom.url + "/api/v1/rules", timeout=10).json()["data"]["groups"]
    assert sum(len(g["rules"]) for g in rules) == 7
    assert all(r["health"] == "ok" for g in rules for r in g["rules"]), rules
    assert httpx.get(prom.url + "/api/v1/alerts", timeout=10).json()["data"]["alerts"] == []

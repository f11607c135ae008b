"""A real Prometheus (Debian's prometheus package, with promtool) scrapes a running local cluster.

The shipped scripts/monitoring/ is checked here: the alert rules with `promtool check rules` and their unit
tests with `promtool test rules`; the example config with `promtool check config`; targets.py writes the
instances' targets; and every query of the Grafana dashboard returns data from this Prometheus once a few
requests (and one live migration) went through the cluster.
"""

from __future__ import annotations

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
from llumnixctl.localcluster import free_port
from tests.streams import Stream, wait_for

MONITORING = Path(__file__).resolve().parents[1] / "scripts" / "monitoring"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
MISSING = ("prometheus/promtool not installed: Debian's prometheus package (scripts/install.sh installs it when "
           "it runs as root where apt-get is)")
# Skipped where Prometheus is missing, except on CI, whose install step must have brought it.
pytestmark = pytest.mark.skipif(not (PROMETHEUS and PROMTOOL) and not os.environ.get("CI"), reason=MISSING)


@pytest.fixture(autouse=True)
def _installed():
    assert PROMETHEUS and PROMTOOL, MISSING

MODEL = "llumnix-sim"
BODY = {"model": MODEL, "prompt": "hello " * 8, "max_tokens": 12, "ignore_eos": True}


def promtool(*args: str, cwd: Path = MONITORING) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_alert_rules_check_and_pass_their_unit_tests():
    res = promtool("check", "rules", "llumnix-alerts.yml")
    assert res.returncode == 0 and "SUCCESS: 6 rules found" in res.stdout, res.stdout + res.stderr
    res = promtool("test", "rules", "llumnix-alerts.test.yml")
    assert res.returncode == 0 and "SUCCESS" in res.stdout, res.stdout + res.stderr


def test_example_config_checks():
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
                 "llumnix_migration_downtime_seconds_bucket", "llumnix_migration_bytes_total"):
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
def prometheus(tmp_path):
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
    c = start_cluster(2, ["instance.min_step_s=0.01"])
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

    missing = empty()
    if missing:  # a rate needs two scrapes of a series in its window
        time.sleep(3)
        missing = empty()
    assert not missing, "\n".join(missing)
    for title, expr in exprs:
        if "histogram_quantile(0.99" in expr and "proxy" in expr:
            values = [float(r["value"][1]) for r in prom.query(concrete(expr))]
            assert any(math.isfinite(v) and v > 0 for v in values), f"{title}: {expr}: {values}"
    # And the alert rules load and evaluate against live data (none fires on a healthy cluster).
    rules = httpx.get(prom.url + "/api/v1/rules", timeout=10).json()["data"]["groups"]
    assert sum(len(g["rules"]) for g in rules) == 6
    assert all(r["health"] == "ok" for g in rules for r in g["rules"]), rules
    assert httpx.get(prom.url + "/api/v1/alerts", timeout=10).json()["data"]["alerts"] == []

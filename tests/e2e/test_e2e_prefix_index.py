"""The cluster's prefix index over real daemons and ZeroMQ (sim instances with sim.prefix_caching): the
instances publish their caches' changes on the token path and to the manager; the proxy's index counts what
the instances' caches hold, and a proxy restarted by kill -9 learns it all again from the instances (CacheSync
on their request sockets, the whole cache back on the token path) without any request being sent."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from tests.streams import Stream, metric, samples, wait_for

pytestmark = pytest.mark.e2e

SYSTEM = "You are a helpful assistant. " * 12  # the shared leading blocks of every prompt here


def _cached(c) -> tuple[float, float, float]:
    """(the proxy's index size, the instances' cache sizes summed, the instances' hit tokens summed)."""
    proxy = metric(samples(httpx.get(c.url + "/metrics", timeout=10).text), "llumnix_proxy_prefix_index_blocks",
                   default=-1.0)
    blocks = hits = 0.0
    for row in c.status()["instances"]:
        got = samples(httpx.get(f"http://{row['metrics_address']}/metrics", timeout=10).text)
        blocks += metric(got, "llumnix_instance_prefix_cache_blocks", default=0.0)
        hits += metric(got, "llumnix_instance_prefix_cache_hit_tokens_total", default=0.0)
    return proxy, blocks, hits


def test_the_proxy_indexes_what_the_instances_cache_and_learns_it_again_after_kill_9(start_cluster):
    c = start_cluster(2, ["sim.prefix_caching=true", "instance.min_step_s=0.01"])
    for k in range(6):
        Stream(c.url, 8, prompt=SYSTEM + f" question {k}").check_sim(8)
    wait_for(lambda: (lambda p, b, h: p == b > 0 and h > 0)(*_cached(c)), 15,
             f"the proxy's index does not count what the instances cache: {_cached(c)}")
    # Status shows the hit rates: per instance and for the cluster, the instances' own counts.
    wait_for(lambda: c.status()["totals"]["prefix_hit_tokens"] == _cached(c)[2], 15, "status lags the instances")
    st = c.status()
    assert 0 < st["totals"]["prefix_hit_tokens"] < st["totals"]["prefix_query_tokens"]
    assert any(r["prefix_hit_rate"] for r in st["instances"])

    proxy = c.proc("proxy")
    os.kill(proxy.pid, signal.SIGKILL)
    wait_for(lambda: proxy.process() is None, 10)
    c.spawn("proxy", proxy.argv)
    wait_for(lambda: _up(c.url), 30, "the restarted proxy did not come up")
    _, blocks, _ = _cached(c)
    wait_for(lambda: _cached(c)[0] == blocks, 10,
             f"the restarted proxy did not learn the caches again: {_cached(c)} (instances' blocks {blocks})")
    # And it keeps following them.
    Stream(c.url, 8, prompt=SYSTEM + " one more").check_sim(8)
    wait_for(lambda: (lambda p, b, h: p == b)(*_cached(c)), 15, f"not followed after the restart: {_cached(c)}")


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _manager_metric(c, name: str) -> float:
    line = next(x for x in open(c.proc("manager").log) if "metrics 127.0.0.1:" in x)
    address = line.split("metrics ")[1].split(")")[0].split(",")[0].strip()
    return metric(samples(httpx.get(f"http://{address}/metrics", timeout=10).text), name, default=0.0)


def test_the_manager_answers_by_its_own_index_when_the_proxy_asks(start_cluster):
    """proxy.dispatch = manager: the proxy sends the prompt's block keys with each Dispatch, and the manager
    places a request where its prefix is cached (its index from the instances' batches): after the first,
    every request of the prefix hits, where a cache-blind choice between two idle instances alternates."""
    c = start_cluster(2, ["sim.prefix_caching=true", "instance.min_step_s=0.01", "proxy.dispatch=manager",
                          "manager.dispatch_policy=llumnix-cache", "sim.block_size=32"])  # the proxy's hashing follows
    Stream(c.url, 4, prompt=SYSTEM + " first").check_sim(4)
    wait_for(lambda: _manager_metric(c, "llumnix_manager_prefix_index_blocks") > 0, 15,
             "the manager's index never counted the first request's blocks")
    before = _cached(c)[2]
    for k in range(4):
        Stream(c.url, 4, prompt=SYSTEM + f" next {k}").check_sim(4)
    wait_for(lambda: _cached(c)[2] > before, 15, "no hit counted")
    got = c.status()["instances"]
    served = [r["id"] for r in got if r["prefix_query_tokens"]]
    assert len(served) == 1, got  # every request went where the prefix is
    assert _manager_metric(c, "llumnix_manager_cache_dispatches_total") >= 4

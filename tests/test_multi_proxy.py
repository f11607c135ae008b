"""A local cluster with several proxies (`llumnixctl up --proxies N`): each serves, `down` stops them all."""

from __future__ import annotations

import json
import urllib.request

import psutil

from conftest import FAST, cli
from llumnixctl import localcluster


def complete(url: str) -> dict:
    body = json.dumps({"model": "llumnix-sim", "prompt": "hello", "max_tokens": 2}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def test_three_proxies_serve_and_down_stops_every_one(tmp_path):
    args = ["up", "--run-dir", str(tmp_path), "--port", "0", "-n", "2", "--proxies", "3", "--json"]
    res = cli(*args, *[a for s in FAST for a in ("--set", s)])
    assert res.returncode == 0, res.stderr
    up = json.loads(res.stdout)
    procs = [localcluster.Proc(p["name"], p["pid"], psutil.Process(p["pid"]).create_time(), p["log"], [])
             for p in up["processes"]]
    try:
        assert up["url"] == up["urls"][0] and len(set(up["urls"])) == 3
        assert sorted(p.name for p in procs if p.name.startswith("proxy")) == ["proxy", "proxy-1", "proxy-2"]
        for url in up["urls"]:
            assert complete(url)["choices"][0]["text"] is not None
        assert localcluster.ClusterState.load(tmp_path).urls == up["urls"]  # saved with the state
        res = cli("down", "--run-dir", str(tmp_path), "--json")
        assert res.returncode == 0, res.stderr
        assert len(json.loads(res.stdout)["stopped"]) == len(procs)
        assert [p.pid for p in procs if p.process() is not None] == []
    finally:
        for p in procs:  # only if an assertion failed before `down`: by pid and start time
            live = p.process()
            if live is not None:
                live.kill()


def test_a_state_file_from_before_several_proxies_loads(tmp_path):
    state = localcluster.ClusterState("tcp://127.0.0.1:1", "http://127.0.0.1:2", "sim", None)
    state.save(tmp_path)
    data = json.loads((tmp_path / localcluster.STATE_FILE).read_text())
    del data["urls"]  # as an older llumnixctl wrote it
    (tmp_path / localcluster.STATE_FILE).write_text(json.dumps(data))
    assert localcluster.ClusterState.load(tmp_path).urls == ["http://127.0.0.1:2"]

"""Sessions over real daemons (sim instances with prefix caching): a conversation's turns, named by OpenAI's
``prompt_cache_key`` (the official client) or by the session header, stay on the instance holding their KV, and
spill to another instance when that one is loaded past sessions.bound; ``llumnixctl sessions --json`` shows them
with where their KV is."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from tests.conftest import cli
from tests.streams import Stream, metric, proxy_metric, samples, wait_for

pytestmark = pytest.mark.e2e

SYSTEM = "You are a careful assistant who answers in one short line. " * 6


def _instance_of(c, request_id: str) -> str:
    """The instance that served ``request_id`` (as sent in x-request-id), by the proxy's access line."""
    def found():
        m = re.search(rf"access \S*-{re.escape(request_id)} .*?instance=(\S+)", Path(c.proc("proxy").log).read_text())
        return m.group(1) if m else None
    return wait_for(found, 10, f"no access line for {request_id}")


def _indexed(c) -> float:
    return proxy_metric(c.url, "llumnix_proxy_prefix_index_blocks")


def _sessions(c) -> dict:
    res = cli("sessions", "--json", "--run-dir", str(c.run_dir))
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _load(c, home: str, other: str, n: int) -> list[Stream]:
    """``n`` long requests running on ``home`` (``other`` cordoned while they are placed)."""
    assert cli("cordon", other, "--run-dir", str(c.run_dir)).returncode == 0
    load = [Stream(c.url, 3000, prompt=f"background {k}") for k in range(n)]
    for s in load:
        s.wait_tokens(1)
    assert cli("uncordon", other, "--run-dir", str(c.run_dir)).returncode == 0
    wait_for(lambda: not any(r["cordoned"] for r in c.status()["instances"]), 10, "still cordoned")
    return load


def _running(c, iid: str) -> int:
    return next(r for r in c.status()["instances"] if r["id"] == iid)["running"]


def test_a_sessions_turns_stick_to_its_kv_and_spill_past_the_bound(start_cluster):
    c = start_cluster(2, ["sim.prefix_caching=true", "instance.min_step_s=0.01", "scheduling.pairing_policy=off",
                          "sessions.bound=1.25"])
    client = c.openai()
    ids = [v["id"] for v in c.status()["instances"]]
    load: list[Stream] = []
    try:
        # A chat: prompt_cache_key through the official client; each turn's prompt is the last one plus more.
        messages = [{"role": "system", "content": SYSTEM}]
        chat_at = []
        for k in range(4):
            messages.append({"role": "user", "content": f"Question {k}: what is {k} plus {k}? " * 3})
            before = _indexed(c)
            rid = f"chat-{k}"
            res = client.chat.completions.create(model="llumnix-sim", messages=messages, max_tokens=4,
                                                 prompt_cache_key="conv-chat", extra_headers={"x-request-id": rid})
            messages.append({"role": "assistant", "content": res.choices[0].message.content or "ok"})
            chat_at.append(_instance_of(c, rid))
            wait_for(lambda: _indexed(c) > before, 10, "the proxy's index did not learn the turn's blocks")
            if k == 0:  # its instance is now busier than the other: by load alone the next turns would go there
                home = chat_at[0]
                other = next(i for i in ids if i != home)
                load += _load(c, home, other, 1)
        assert chat_at == [home] * 4, f"the chat's turns moved: {chat_at}"

        # A completion session named by the header (a client without prompt_cache_key in its API: extra_body works
        # too, as below).
        prompt = SYSTEM + " Tool output follows."
        done_at = []
        for k in range(3):
            prompt += f" Step {k} result: {k * 7}." * 4
            before = _indexed(c)
            rid = f"agent-{k}"
            client.completions.create(model="llumnix-sim", prompt=prompt, max_tokens=4,
                                      extra_headers={"x-session-id": "agent-7", "x-request-id": rid})
            done_at.append(_instance_of(c, rid))
            wait_for(lambda: _indexed(c) > before, 10, "the proxy's index did not learn the turn's blocks")
        assert len(set(done_at)) == 1, f"the agent's turns moved: {done_at}"

        # Load the chat's instance past the bound: 3 running there, none on the other, and
        # 3 + 1 > ceil(1.25 x (3 + 1) / 2) = 3: the next turn spills.
        load += _load(c, home, other, 2)
        wait_for(lambda: _running(c, home) >= 3, 10, "the load did not land on the chat's instance")
        messages.append({"role": "user", "content": "One more question, please. " * 3})
        client.chat.completions.create(model="llumnix-sim", messages=messages, max_tokens=4,
                                       extra_body={"prompt_cache_key": "conv-chat"},
                                       extra_headers={"x-request-id": "chat-spill"})
        assert _instance_of(c, "chat-spill") == other
    finally:
        for s in load:
            s.stop_after = 0
        for s in load:
            s.join(30)

    got = samples(httpx.get(c.url + "/metrics", timeout=10).text)
    assert metric(got, "llumnix_proxy_session_dispatches_total", how="affinity") >= 5  # turns 2-4, 2-3
    assert metric(got, "llumnix_proxy_session_dispatches_total", how="spilled", default=0) + \
        metric(got, "llumnix_proxy_session_dispatches_total", how="pull", default=0) >= 1
    assert metric(got, "llumnix_proxy_sessions") == 2

    # The operator's view: both sessions, their turns, the last instance, where their KV is.
    def both():
        rows = {r["session"]: r for r in _sessions(c)["sessions"]}
        return rows if rows.get("conv-chat", {}).get("turns") == 5 and rows.get("agent-7", {}).get("turns") == 3 \
            else None
    rows = wait_for(both, 10, lambda: f"the manager's sessions: {_sessions(c)}")
    assert rows["conv-chat"]["instance"] == other and rows["agent-7"]["instance"] == done_at[0]
    agent = rows["agent-7"]
    assert agent["blocks"] > 0 and agent["engine_blocks"].get(done_at[0], 0) > 0
    assert agent["instances"][0] == done_at[0] and agent["prompt_tokens"] > 0 and agent["age_s"] >= agent["idle_s"]
    assert _sessions(c)["known"] == 2


def test_a_manager_with_re_homing_off_runs_and_serves(start_cluster):
    """sessions.rehome_sessions = 0 ("off") ended the manager's re-homing loop at once, which the manager takes
    for a failed task: it exited at start-up, and the cluster never came up."""
    c = start_cluster(instances=1, sets=["sessions.rehome_sessions=0", "sessions.rehome_interval_s=0.05"])
    out = httpx.post(c.url + "/v1/completions", json={"model": "llumnix-sim", "prompt": "hello", "max_tokens": 4},
                     timeout=30)
    assert out.status_code == 200, out.text
    assert c.proc("manager").process() is not None  # still running after many re-homing intervals

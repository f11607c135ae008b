"""The session trace (llumnixctl/experiments/traces/sessions.py): closed-loop turns whose prompts grow by the
previous answer and a new message, shared agent system prompts, turns within their bounds, sized against a
cluster's KV by its working set; deterministic by seed."""

from __future__ import annotations

import pytest

from llumnixctl.experiments.traces import cache as tracecache
from llumnixctl.experiments.traces import sessions as tsessions


def _by_session(reqs):
    out: dict = {}
    for r in reqs:
        out.setdefault(r.session, []).append(r)
    return {s: sorted(v, key=lambda r: r.turn) for s, v in out.items()}


def test_each_turn_is_the_previous_prompt_its_answer_and_a_new_message():
    reqs = tsessions.sessions(20, session_rate=2.0, turns=(4, 8), agents=3, system_tokens=1024, seed=1)
    sessions = _by_session(reqs)
    assert len(sessions) == 20
    for turns in sessions.values():
        assert [t.turn for t in turns] == list(range(len(turns)))
        assert 1 <= len(turns) <= 8
        assert turns[0].think_s == 0.0
        for prev, cur in zip(turns, turns[1:]):
            # the previous prompt, then its answer (as long as its output), then one new message
            assert cur.segments[:len(prev.segments)] == prev.segments
            assert cur.segments[len(prev.segments)][1] == prev.output_tokens
            assert len(cur.segments) == len(prev.segments) + 2
            assert cur.prompt_tokens > prev.prompt_tokens
            assert cur.arrival_s >= prev.arrival_s and cur.think_s > 0
        assert all(t.prompt_tokens + t.output_tokens <= 4096 for t in turns)
    ids = [tracecache.prompt_ids(t, 1000) for t in sessions[0]]
    assert ids[1][:len(ids[0])] == ids[0]  # as token ids too


def test_sessions_share_a_few_agent_system_prompts_of_their_length():
    reqs = tsessions.sessions(40, session_rate=2.0, agents=3, system_tokens=1024, seed=0)
    systems = {r.segments[0] for r in reqs}
    assert len(systems) <= 3 and all(length == 1024 for _, length in systems)
    assert len(systems) >= 2  # 40 sessions over 3 agents: more than one in use


def test_turns_stay_within_their_bounds_when_contexts_allow():
    reqs = tsessions.sessions(30, session_rate=1.0, turns=(20, 40), agents=2, system_tokens=256,
                              message=(16, 64), reply=(16, 64), max_context=16384, seed=2)
    counts = [len(v) for v in _by_session(reqs).values()]
    assert min(counts) >= 20 and max(counts) <= 40


def test_the_same_seed_gives_the_same_trace_and_fewer_sessions_are_its_first_ones():
    a = tsessions.sessions(25, session_rate=3.0, seed=7)
    assert a == tsessions.sessions(25, session_rate=3.0, seed=7)
    assert a != tsessions.sessions(25, session_rate=3.0, seed=8)
    b = tsessions.sessions(10, session_rate=3.0, seed=7)
    first = sorted((r.session, r.turn, r.segments, r.output_tokens) for r in a if r.session < 10)
    assert first == sorted((r.session, r.turn, r.segments, r.output_tokens) for r in b)


def test_a_working_set_target_sizes_the_trace_and_the_ratio_is_reported():
    kv = 4 * 4096
    reqs = tsessions.sessions(session_rate=2.0, working_set_tokens=4 * kv, agents=4, system_tokens=1024, seed=0)
    ws = tsessions.working_set(reqs)
    assert ws >= 4 * kv
    n = len({r.session for r in reqs})
    fewer = tsessions.sessions(n - 1, session_rate=2.0, agents=4, system_tokens=1024, seed=0)
    assert tsessions.working_set(fewer) < 4 * kv  # no more sessions than it takes
    d = tsessions.describe(reqs, kv_tokens=kv)
    assert d["working_set_tokens"] == ws and d["working_set_over_kv"] >= 4.0
    assert d["sessions"] == n and d["turns"] == len(reqs)
    assert 0 < d["nominal_live_peak_tokens"] <= ws
    assert 0.5 < d["shareable_fraction"] < 1.0  # most of a growing conversation was seen before


def test_the_working_set_counts_distinct_segments_and_last_answers():
    reqs = tsessions.sessions(2, session_rate=1.0, turns=(2, 2), agents=1, system_tokens=100, seed=0)
    s = _by_session(reqs)
    expect = 100 + sum(s[k][-1].prompt_tokens - 100 + s[k][-1].output_tokens for k in s)
    assert tsessions.working_set(reqs) == expect


def test_bad_shapes_are_refused_with_what_was_wrong():
    with pytest.raises(ValueError, match="number of sessions"):
        tsessions.sessions(0, session_rate=1.0)
    with pytest.raises(ValueError, match="session rate"):
        tsessions.sessions(3, session_rate=0.0)
    with pytest.raises(ValueError, match="max_context"):
        tsessions.sessions(3, session_rate=1.0, system_tokens=4090, max_context=4096)
    with pytest.raises(ValueError, match="turns"):
        tsessions.sessions(3, session_rate=1.0, turns=(5, 2))


def test_a_lead_token_shifts_what_a_perfect_cache_serves():
    reqs = tsessions.sessions(10, session_rate=1.0, seed=0)
    assert tracecache.sharing(reqs, 16, 1)["prompt_tokens"] == tracecache.sharing(reqs, 16)["prompt_tokens"] + len(reqs)


def test_trace_generate_writes_a_session_trace_that_loads_back_whole(tmp_path):
    import json
    import subprocess
    import sys

    from llumnixctl.experiments.traces import files as tracefiles

    out = tmp_path / "s.jsonl"
    res = subprocess.run([sys.executable, "-m", "llumnixctl.main", "trace", "generate", str(out), "--shape", "sessions",
                          "-n", "6", "--rate", "2", "--prefixes", "2", "--prefix-tokens", "256", "--turns-min", "3",
                          "--turns-max", "5", "--json"], capture_output=True, text=True, check=True)
    data = json.loads(res.stdout)
    expect = tsessions.sessions(6, session_rate=2, turns=(3, 5), agents=2, system_tokens=256, message=(16, 128),
                                reply=(16, 256), think=5.0, max_context=4096)
    assert data["sessions"] == 6 and data["working_set_tokens"] == tsessions.working_set(expect)
    assert tracefiles.load(out) == expect  # segments, sessions, turns and think times round-trip

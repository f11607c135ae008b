"""Shared-content traces (llumnixctl/experiments/traces/cache.py): what they share, sessions, the JSONL round
trip, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from llumnixctl.experiments.traces import cache as tracecache, files as tracefiles, mix as tracemix


def test_shared_prefix_requests_are_a_system_prompt_and_a_suffix_of_their_own():
    reqs = tracecache.shared_prefix(400, rate=10, prefixes=8, prefix_tokens=64, skew=1.0, seed=3)
    assert [r.index for r in reqs] == list(range(400))
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(reqs, reqs[1:]))
    for r in reqs:
        (p, n), (own, m) = r.segments
        assert n == 64 and r.prompt_tokens == 64 + m and own == f"s3-r{r.index}"
    popularity = Counter(r.segments[0][0] for r in reqs)
    assert popularity.most_common(1)[0][0] == "s3-p0"  # zipf: prompt 0 is the most used
    ids = [tracecache.prompt_ids(r, 1000) for r in reqs[:50]]
    for r, x in zip(reqs[:50], ids):
        assert len(x) == r.prompt_tokens
    same = [x for r, x in zip(reqs[:50], ids) if r.segments[0] == reqs[0].segments[0]]
    assert len(same) > 1 and all(x[:64] == same[0][:64] for x in same)
    assert tracecache.shared_prefix(400, rate=10, prefixes=8, prefix_tokens=64, seed=3) == reqs  # seeded


def test_a_hot_prompt_takes_its_share():
    reqs = tracecache.shared_prefix(2000, rate=10, prefixes=8, prefix_tokens=32, hot=0.8, seed=1)
    share = sum(r.segments[0][0] == "s1-p0" for r in reqs) / len(reqs)
    assert 0.76 < share < 0.84


def test_a_turn_resends_the_conversation_so_far():
    reqs = tracecache.multi_turn(300, rate=5, turns=(2, 5), system_prompts=4, system_tokens=32, think=1.0,
                                 max_context=1024, seed=2)
    sessions: dict[int, list] = {}
    for r in reqs:
        sessions.setdefault(r.session, []).append(r)
        assert r.prompt_tokens == sum(n for _, n in r.segments) and r.prompt_tokens + r.output_tokens <= 1024
    for turns in sessions.values():
        turns.sort(key=lambda r: r.turn)
        assert [r.turn for r in turns] == list(range(len(turns)))  # no gaps, in order of arrival too
        assert all(b.arrival_s >= a.arrival_s for a, b in zip(turns, turns[1:]))
        for a, b in zip(turns, turns[1:]):
            # the next turn: everything before, this turn's reply (its output length), a new message
            assert b.segments[:len(a.segments)] == a.segments
            assert b.segments[len(a.segments)][1] == a.output_tokens
            assert len(b.segments) == len(a.segments) + 2
            assert b.think_s >= 0
    prev = tracecache.previous_turns(reqs)
    assert all(reqs[p].session == reqs[i].session and reqs[p].turn == reqs[i].turn - 1 for i, p in prev.items())
    assert len(prev) == len(reqs) - len(sessions)


def test_sharing_counts_the_leading_blocks_a_perfect_cache_would_save():
    reqs = tracecache.shared_prefix(10, rate=1, prefixes=1, prefix_tokens=64, suffix=(16, 16), seed=0)
    s = tracecache.sharing(reqs, block_size=16)
    assert s["prompt_tokens"] == 800 and s["shareable_tokens"] == 9 * 64


def test_jsonl_keeps_segments_and_sessions_and_refuses_bad_ones(tmp_path):
    reqs = tracecache.multi_turn(50, rate=5, seed=0)
    path = tmp_path / "t.jsonl"
    tracefiles.save_jsonl(reqs, path)
    assert tracefiles.load(path) == reqs
    row = json.loads(path.read_text().splitlines()[0])
    row["segments"][0][1] += 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(row) + "\n")
    with pytest.raises(tracefiles.TraceFormatError, match="segments hold"):
        tracefiles.load(bad)
    row["segments"] = [["x", 0]]
    bad.write_text(json.dumps(row) + "\n")
    with pytest.raises(tracefiles.TraceFormatError, match="segments must be"):
        tracefiles.load(bad)


def test_clipping_keeps_the_leading_segments():
    reqs = tracecache.shared_prefix(20, rate=1, prefixes=2, prefix_tokens=100, suffix=(50, 60), seed=0)
    clipped = tracemix.clip(reqs, 120)
    for r, c in zip(reqs, clipped):
        assert c.prompt_tokens == 119 and sum(n for _, n in c.segments) == 119
        assert tracecache.prompt_ids(c, 1000) == tracecache.prompt_ids(r, 1000)[:119]


def test_trace_generate_writes_shared_traces(tmp_path):
    out = tmp_path / "sp.jsonl"
    res = subprocess.run([sys.executable, "-m", "llumnixctl.main", "trace", "generate", str(out), "--shape",
                          "shared-prefix", "-n", "50", "--prefixes", "4", "--prefix-tokens", "64", "--json"],
                         capture_output=True, text=True, check=True)
    data = json.loads(res.stdout)
    assert data["shape"] == "shared-prefix" and data["shareable_fraction"] > 0.3
    assert len(tracefiles.load(out)) == 50
    res = subprocess.run([sys.executable, "-m", "llumnixctl.main", "trace", "generate", str(out), "--shape",
                          "nope"], capture_output=True, text=True)
    assert res.returncode == 2 and "unknown --shape" in res.stderr


def test_a_multi_turn_trace_whose_turns_cannot_fit_is_refused_not_generated_forever():
    with pytest.raises(ValueError, match="no turn fits"):
        tracecache.multi_turn(10, rate=1, system_tokens=384, message=(16, 32), reply=(16, 32), max_context=256)
    scaled = tracemix.scale_rate(tracecache.multi_turn(20, rate=1, think=4.0, seed=0), 2.0)
    assert all(r.think_s == t.think_s / 2 for r, t in zip(scaled, tracecache.multi_turn(20, rate=1, think=4.0, seed=0)))

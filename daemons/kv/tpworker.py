"""The class vLLM mixes into each worker of a tensor-parallel instance (``worker_extension_cls``, named in
daemons/engine/vllm_internals.py): where the engine's runner-state verbs (daemons/engine/vllm_worker.py) and
the KV transport's rank (daemons/kv/ranks.py ``RankKv``) meet, so that neither of those imports the other.
The engine calls these methods on every rank with ``collective_rpc``, between steps; a rank's KV transfers
are driven apart from the steps, over its control thread (``llumnix_kv_serve``)."""

from __future__ import annotations

import os
import sys

from daemons.engine.vllm_worker import attention_backends, commit_runner_state, generator_state
from daemons.kv.layout import KvBlocks
from daemons.kv.rankctl import RankServer
from daemons.kv.ranks import RankKv


class LlumnixWorker:
    """Mixed into vLLM's worker class (``worker_extension_cls``); ``self`` is the worker."""

    def _llumnix_rank(self) -> RankKv:
        rank_kv = getattr(self, "_llumnix_kv", None)
        if rank_kv is None:
            raise RuntimeError("llumnix_kv_layout was not called on this worker")
        return rank_kv

    def llumnix_own_group(self, nice: int) -> str:
        """Move this rank into a scheduling group of its own at niceness ``nice`` ('' when done, else why not).

        Where the kernel groups tasks by session (autogroup: on by default on desktop and many server
        kernels, for every task outside a cpu cgroup), niceness only orders the threads within one group,
        and groups share the CPU equally: a rank niced inside its instance's session still took a whole
        group's share from every other session on the host (an operator's llumnixctl, the other daemons).
        A session of its own, with that group's niceness raised, gives the host's other sessions the CPU
        first. Under a cpu cgroup (systemd) autogroups do not apply and the threads' niceness already does."""
        try:
            os.setsid()
        except OSError as exc:
            return f"setsid: {exc}"
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write(f"{nice}\n")
        except FileNotFoundError:
            return ""  # no autogroups in this kernel: niceness orders all threads already
        except OSError as exc:
            return f"/proc/self/autogroup: {exc}"
        return ""

    def llumnix_kv_layout(self, describe: str, layout: str, tp: int) -> tuple[str, int]:
        """This rank's KV spec (``describe`` plus its attention backends) and a block's bytes on this rank."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        rank_kv = getattr(self, "_llumnix_kv", None)
        if rank_kv is None:
            runner = self.model_runner
            kv = KvBlocks(list(runner.kv_caches), f"{describe}/{attention_backends(runner)}", layout, tp)
            rank_kv = self._llumnix_kv = RankKv(kv, get_tensor_model_parallel_rank())
        return rank_kv.kv.spec, rank_kv.kv.block_nbytes

    def llumnix_kv_serve(self, directory: str) -> str:
        """Start this rank's KV control thread (daemons/kv/rankctl.py ``RankServer``), whose calls the llumlet makes
        beside the engine's steps; its endpoint. Once per worker."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        server = getattr(self, "_llumnix_kv_server", None)
        if server is None:
            # The control thread answers while the worker's thread runs a step's Python: let it in sooner than
            # the default 5 ms (an answer's delay is a migration's, and the last stage's is downtime).
            sys.setswitchinterval(0.001)
            server = self._llumnix_kv_server = RankServer(self._llumnix_rank, directory,
                                                          get_tensor_model_parallel_rank())
        return server.endpoint

    def llumnix_generator_state(self, request_id: str) -> bytes:
        return generator_state(self.model_runner, request_id)

    def llumnix_commit(self, request_id: str, prompt_token_ids: list[int], params, seeded: bool, engine_state: bytes,
                       block_ids: list[int], num_computed_tokens: int, output_token_ids: list[int],
                       came_back: bool, lora_request=None) -> None:
        from vllm.v1.worker.gpu_input_batch import CachedRequestState

        commit_runner_state(self.model_runner, CachedRequestState, request_id, prompt_token_ids, params, seeded,
                            engine_state, block_ids, num_computed_tokens, output_token_ids, came_back, lora_request)

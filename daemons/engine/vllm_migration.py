"""The vllm engine's requests (``LiveRequests``) and its side of a migration (``VllmMigrations``, for
daemons/engine/vllm_backend.py): the source's view, suspend and resume, and the destination's reservation
(with what the prefix cache holds), commit and release."""

from __future__ import annotations

import time
from typing import Callable, Iterator

from daemons.engine.base import EngineError, MigrationView, check_incoming
from daemons.engine.vllm_internals_migration import VllmMoves
from daemons.engine.vllm_internals_state import VllmState
from daemons.wire import MigratingRequest, RequestState, SamplingParams


class LiveRequest:
    __slots__ = ("rid", "req", "emitted", "sampling", "adapter", "adapter_path", "session", "retain_s")

    def __init__(self, rid: str, req, sampling, adapter: str = "", adapter_path: str = "", session: str = "",
                 retain_s: float = 0.0):
        self.rid = rid
        self.req = req  # vLLM's Request
        self.emitted = 0  # tokens sent out: the next TokenOut's index
        self.sampling = sampling  # ours, as the client gave it: travels with a migration
        self.adapter = adapter  # its LoRA adapter ("": the base model); travels with a migration too
        self.adapter_path = adapter_path
        self.session = session  # its conversation: its blocks are retained when it ends (daemons/engine/tier.py)
        self.retain_s = retain_s


class LiveRequests:
    """The requests vLLM holds for the engine (waiting, running, suspended) by id, and the preemptions of
    those that left."""

    def __init__(self, gone: Callable[[LiveRequest], None] = lambda live: None):
        """``gone``: told of each request that leaves the engine (finished, aborted, migrated out, a
        reservation released): its adapter's count of running requests drops."""
        self._live: dict[str, LiveRequest] = {}
        self._finished_preemptions = 0
        self.gone = gone

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def __getitem__(self, request_id: str) -> LiveRequest:
        return self._live[request_id]

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[LiveRequest]:
        return iter(self._live.values())

    def get(self, request_id: str) -> LiveRequest | None:
        return self._live.get(request_id)

    def add(self, live: LiveRequest) -> LiveRequest:
        self._live[live.rid] = live
        return live

    def forget(self, live: LiveRequest) -> None:
        del self._live[live.rid]
        self._finished_preemptions += live.req.num_preemptions
        self.gone(live)

    def preemptions(self) -> int:
        return self._finished_preemptions + sum(l.req.num_preemptions for l in self._live.values())

    def clear(self) -> None:
        self._live.clear()


class VllmMigrations:
    """The VllmEngine's migrating requests: it owns the suspended ones (migrating out), the reservations
    (migrating in) and what the prefix cache held of each reservation; it moves requests between them and the
    engine's ``LiveRequests`` through vLLM's scheduler and KV cache manager (``state`` reads them, ``moves``
    changes them). ``sampling_params`` turns our sampling parameters into vLLM's."""

    def __init__(self, live: LiveRequests, state: VllmState, moves: VllmMoves, sampling_params: Callable,
                 lora: Callable[[str, str, str], object]):
        """``lora(adapter, path, request_id)``: the ``LoRARequest`` of an incoming request's adapter, loaded
        first where it is not held (before stage 0's reservation: no block is taken for a request whose
        adapter cannot load)."""
        self._lora = lora
        self._live = live
        self._s = state
        self._moves = moves
        self._sampling_params = sampling_params
        self._suspended: set[str] = set()
        self._reserved: dict[str, LiveRequest] = {}
        self._cached: dict[str, int] = {}  # reservation -> its leading blocks found in the prefix cache

    # ---------------------------------------------------------------- what the engine asks

    def reserving(self, request_id: str) -> bool:
        return request_id in self._reserved

    def suspended(self) -> list[str]:
        return list(self._suspended)

    def abort_suspended(self, live: LiveRequest) -> bool:
        """Drop a suspended request from vLLM (the engine forgets it). False if it is not suspended."""
        if live.rid not in self._suspended:
            return False
        self._suspended.discard(live.rid)
        self._moves.drop_suspended(live.req)
        return True

    # ---------------------------------------------------------------- source

    def migration_view(self, request_id: str) -> MigrationView | None:
        live = self._live.get(request_id)
        if live is None or request_id in self._suspended or not self._moves.is_running(live.req):
            return None
        return MigrationView(block_ids=list(self._s.block_ids(request_id)), computed_tokens=live.req.num_computed_tokens)

    def migrating_request(self, request_id: str) -> MigratingRequest:
        live = self._live[request_id]
        r = live.req
        return MigratingRequest(request_id=request_id, prompt_token_ids=list(r.prompt_token_ids), sampling=live.sampling,
                                reply_to="", priority=self._s.priority(r), arrival_time=r.arrival_time,
                                max_total=min(r.num_prompt_tokens + live.sampling.max_tokens, self._s.max_model_len),
                                adapter=live.adapter, adapter_path=live.adapter_path, session=live.session,
                                retain_s=live.retain_s)

    def suspend(self, request_id: str) -> RequestState:
        live = self._live[request_id]
        if request_id in self._suspended or not self._moves.is_running(live.req):
            raise KeyError(request_id)
        engine_state = self._moves.suspend(live.req)
        self._suspended.add(request_id)
        return RequestState(output_token_ids=list(live.req.output_token_ids), emitted=live.emitted,
                            engine_state=engine_state)

    def resume(self, request_id: str) -> None:
        self._suspended.remove(request_id)
        self._moves.resume(self._live[request_id].req)

    def drop_migrated(self, request_id: str) -> None:
        self._suspended.remove(request_id)
        live = self._live[request_id]
        self._moves.drop_suspended(live.req)
        self._live.forget(live)

    # ---------------------------------------------------------------- destination

    def reserve(self, request: MigratingRequest, tokens: int) -> list[int]:
        rid = request.request_id
        live = self._reserved.get(rid)
        max_model_len = self._s.max_model_len
        if live is None:
            check_incoming(request, rid in self._live, max_model_len, self._s.vocab_size)
            try:
                params = self._sampling_params(request.sampling)
            except self._s.m.request_errors as exc:
                raise EngineError(str(exc)) from exc
            lora = self._lora(request.adapter, request.adapter_path, rid) if request.adapter else None
            req = self._moves.build(rid, list(request.prompt_token_ids), params, request.arrival_time or time.time(),
                                    request.priority, lora)
            live = LiveRequest(rid, req, request.sampling, request.adapter, request.adapter_path, request.session,
                               request.retain_s)
        if tokens > max_model_len:
            if rid not in self._reserved:
                self._live.gone(live)
            raise EngineError(f"{tokens} tokens exceed this instance's context limit {max_model_len}")
        if rid not in self._reserved:  # the first hold takes what the prefix cache has of the prompt
            blocks, self._cached[rid] = self._moves.allocate_first(live.req, tokens) or (None, 0)
        else:
            blocks = self._moves.allocate(live.req, tokens)
        if blocks is None:
            if rid not in self._reserved:
                self._moves.free(live.req)
                self._cached.pop(rid, None)
                self._live.gone(live)
            raise EngineError(f"no room: {-(-tokens // self._s.block_size)} blocks wanted, "
                              f"{self._s.blocks_free()} free")
        self._reserved[rid] = live
        return list(blocks)

    def cached_blocks(self, request_id: str) -> int:
        return self._cached.get(request_id, 0)

    def prefix_hits(self, prompts: list[list[int]]) -> list[int]:
        try:
            return self._moves.prefix_hits(prompts, self._sampling_params(SamplingParams(max_tokens=1)))
        except self._s.m.request_errors as exc:
            raise EngineError(str(exc)) from exc

    def commit(self, request_id: str, state: RequestState) -> None:
        live = self._reserved[request_id]
        tokens = len(live.req.prompt_token_ids) + len(state.output_token_ids) - 1
        if -(-tokens // self._s.block_size) > len(self._s.block_ids(request_id)):
            raise EngineError(f"the reservation cannot hold {tokens} tokens")
        del self._reserved[request_id]
        self._cached.pop(request_id, None)
        self._moves.commit(live.req, list(state.output_token_ids), state.engine_state)
        live.emitted = state.emitted
        self._live.add(live)

    def release(self, request_id: str) -> bool:
        live = self._reserved.pop(request_id, None)
        self._cached.pop(request_id, None)
        if live is None:
            return False
        self._moves.free(live.req)
        self._live.gone(live)
        return True

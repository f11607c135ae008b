"""The vllm engine's side of a migration (daemons/engine/vllm_backend.py): the source's view, suspend and
resume, and the destination's reservation (with what the prefix cache holds), commit and release."""

from __future__ import annotations

import time

from daemons.engine.base import EngineError, MigrationView, check_incoming
from daemons.wire import MigratingRequest, RequestState, SamplingParams


class LiveRequest:
    __slots__ = ("rid", "req", "emitted", "sampling")

    def __init__(self, rid: str, req, sampling):
        self.rid = rid
        self.req = req  # vLLM's Request
        self.emitted = 0  # tokens sent out: the next TokenOut's index
        self.sampling = sampling  # ours, as the client gave it: travels with a migration


class VllmMigrationMixin:
    """Of the VllmEngine: moves requests between its tables (``_live``, ``_suspended``, ``_reserved``,
    ``_cached``) through vLLM's scheduler and KV cache manager (``_v``)."""

    def migration_view(self, request_id: str) -> MigrationView | None:
        live = self._live.get(request_id)
        if live is None or request_id in self._suspended or not self._v.is_running(live.req):
            return None
        return MigrationView(block_ids=list(self._v.block_ids(request_id)), computed_tokens=live.req.num_computed_tokens)

    def migrating_request(self, request_id: str) -> MigratingRequest:
        live = self._live[request_id]
        r = live.req
        return MigratingRequest(request_id=request_id, prompt_token_ids=list(r.prompt_token_ids), sampling=live.sampling,
                                reply_to="", priority=self._v.priority(r), arrival_time=r.arrival_time,
                                max_total=min(r.num_prompt_tokens + live.sampling.max_tokens, self.max_model_len))

    def suspend(self, request_id: str) -> RequestState:
        live = self._live[request_id]
        if request_id in self._suspended or not self._v.is_running(live.req):
            raise KeyError(request_id)
        engine_state = self._v.suspend(live.req)
        self._suspended.add(request_id)
        return RequestState(output_token_ids=list(live.req.output_token_ids), emitted=live.emitted,
                            engine_state=engine_state)

    def resume(self, request_id: str) -> None:
        self._suspended.remove(request_id)
        self._v.resume(self._live[request_id].req)

    def drop_migrated(self, request_id: str) -> None:
        self._suspended.remove(request_id)
        live = self._live[request_id]
        self._v.drop_suspended(live.req)
        self._forget(live)

    # ---------------------------------------------------------------- migration, destination

    def reserve(self, request: MigratingRequest, tokens: int) -> list[int]:
        rid = request.request_id
        live = self._reserved.get(rid)
        if live is None:
            check_incoming(request, rid in self._live, self.max_model_len, self._v.vocab_size)
            try:
                params = self._v.sampling_params(request.sampling)
            except self._v.m.request_errors as exc:
                raise EngineError(str(exc)) from exc
            req = self._v.build(rid, list(request.prompt_token_ids), params, request.arrival_time or time.time(),
                                request.priority)
            live = LiveRequest(rid, req, request.sampling)
        if tokens > self.max_model_len:
            raise EngineError(f"{tokens} tokens exceed this instance's context limit {self.max_model_len}")
        if rid not in self._reserved:  # the first hold takes what the prefix cache has of the prompt
            blocks, self._cached[rid] = self._v.allocate_first(live.req, tokens) or (None, 0)
        else:
            blocks = self._v.allocate(live.req, tokens)
        if blocks is None:
            if rid not in self._reserved:
                self._v.free(live.req)
                self._cached.pop(rid, None)
            raise EngineError(f"no room: {-(-tokens // self.block_size)} blocks wanted, "
                              f"{self._v.blocks_free()} free")
        self._reserved[rid] = live
        return list(blocks)

    def cached_blocks(self, request_id: str) -> int:
        return self._cached.get(request_id, 0)

    def prefix_hits(self, prompts: list[list[int]]) -> list[int]:
        try:
            return self._v.prefix_hits(prompts, self._v.sampling_params(SamplingParams(max_tokens=1)))
        except self._v.m.request_errors as exc:
            raise EngineError(str(exc)) from exc

    def commit(self, request_id: str, state: RequestState) -> None:
        live = self._reserved[request_id]
        tokens = len(live.req.prompt_token_ids) + len(state.output_token_ids) - 1
        if -(-tokens // self.block_size) > len(self._v.block_ids(request_id)):
            raise EngineError(f"the reservation cannot hold {tokens} tokens")
        del self._reserved[request_id]
        self._cached.pop(request_id, None)
        self._v.commit(live.req, list(state.output_token_ids), state.engine_state)
        live.emitted = state.emitted
        self._live[request_id] = live

    def release(self, request_id: str) -> bool:
        live = self._reserved.pop(request_id, None)
        self._cached.pop(request_id, None)
        if live is None:
            return False
        self._v.free(live.req)
        return True

"""The sim engine's side of a migration (daemons/engine/sim.py): the source's view, suspend and resume, and
the destination's reservation, commit and release."""

from __future__ import annotations

from daemons.engine.base import EngineError, MigrationView, check_incoming
from daemons.engine.sim_requests import SimRequest, cdiv
from daemons.wire import MigratingRequest, RequestState


class SimMigrationMixin:
    """Of the SimEngine: moves requests between its tables (``_running``, ``_suspended``, ``_reserved``) and
    the free list."""

    def migration_view(self, request_id: str) -> MigrationView | None:
        req = self._running.get(request_id)
        if req is None:
            return None
        return MigrationView(block_ids=list(req.blocks), computed_tokens=req.prompt_len + req.generated)

    def migrating_request(self, request_id: str) -> MigratingRequest:
        req = self._reqs[request_id]
        # The sim derives tokens from the request id alone, so it needs no prompt ids; their count must travel
        # (and the ids themselves with a prefix cache: the destination names its blocks' content by them).
        prompt = req.tokens[:req.prompt_len] if req.tokens is not None else [0] * req.prompt_len
        return MigratingRequest(request_id=req.rid, prompt_token_ids=prompt, sampling=req.sampling,
                                reply_to="", priority=req.priority, arrival_time=req.arrival_time, max_total=req.max_total)

    def suspend(self, request_id: str) -> RequestState:
        req = self._running[request_id]
        self._unrun(req)
        self._suspended[request_id] = req
        # The sim's outputs are a function of (request id, index); only the count matters (and the ids, with
        # a prefix cache).
        outputs = req.tokens[req.prompt_len:] if req.tokens is not None else [0] * req.generated
        return RequestState(output_token_ids=outputs, emitted=req.generated)

    def resume(self, request_id: str) -> None:
        self._run(self._suspended.pop(request_id))

    def drop_migrated(self, request_id: str) -> None:
        req = self._suspended.pop(request_id)
        del self._reqs[request_id]
        self._release(req)

    # ---------------------------------------------------------------- migration, destination

    def reserve(self, request: MigratingRequest, tokens: int) -> list[int]:
        rid = request.request_id
        req = self._reserved.get(rid)
        if req is None:
            req = SimRequest(check_incoming(request, rid in self._reqs, self.max_model_len), self.max_model_len)
            if self.cache is not None:
                req.tokens = list(request.prompt_token_ids)
        need = cdiv(tokens, self.block_size) - len(req.blocks)
        if need > 0:
            # Migration must not push this instance into preempting its own requests: keep the watermark.
            if len(self._free) - need < self._watermark_blocks:
                if not req.blocks:
                    self._reserved.pop(rid, None)
                raise EngineError(f"no room: {need} more blocks wanted, {len(self._free)} free "
                                  f"(watermark {self._watermark_blocks:.0f})")
            taken = [self._free.popleft() for _ in range(need)]
            if self.cache is not None:
                for block in taken:
                    self.cache.taken(block)
            req.blocks.extend(taken)
        self._reserved[rid] = req
        return list(req.blocks)

    def cached_blocks(self, request_id: str) -> int:
        return 0  # no prefix cache

    def prefix_hits(self, prompts: list[list[int]]) -> list[int]:
        return [0] * len(prompts)

    def commit(self, request_id: str, state: RequestState) -> None:
        req = self._reserved[request_id]
        generated = len(state.output_token_ids)
        if cdiv(req.prompt_len + generated, self.block_size) > len(req.blocks):
            raise EngineError(f"reservation of {len(req.blocks)} blocks cannot hold {req.prompt_len + generated} tokens")
        del self._reserved[request_id]
        req.generated = generated
        if req.tokens is not None:
            req.tokens = req.tokens[:req.prompt_len] + list(state.output_token_ids)
        self._reqs[request_id] = req
        self._run(req)  # with the priority it had on the source, admitted now

    def release(self, request_id: str) -> bool:
        req = self._reserved.pop(request_id, None)
        if req is None:
            return False
        self._release(req)
        return True

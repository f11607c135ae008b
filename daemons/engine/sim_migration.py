"""The sim engine's side of a migration (daemons/engine/sim.py): the source's view, suspend and resume, and
the destination's reservation, commit and release."""

from __future__ import annotations

from typing import Callable

from daemons.engine.base import EngineError, MigrationView, check_incoming
from daemons.engine.sim_requests import SimRequestTable, SimBlocks, SimRequest, cdiv
from daemons.wire import MigratingRequest, RequestState


class SimEngineMigrations:
    """The SimEngine's migrating requests: it owns the suspended ones (migrating out: no steps, blocks kept)
    and the reserved ones (migrating in: blocks held, not yet running), and moves requests between them, the
    engine's request table and the free list."""

    def __init__(self, table: SimRequestTable, blocks: SimBlocks, block_size: int, max_model_len: int,
                 adapter: Callable[[MigratingRequest], None] = lambda request: None):
        """``adapter``: an incoming request's LoRA adapter, loaded before its first hold (EngineError if it cannot)."""
        self._adapter = adapter
        self._table = table
        self._blocks = blocks
        self._block_size = block_size
        self._max_model_len = max_model_len
        self._suspended: dict[str, SimRequest] = {}
        self._reserved: dict[str, SimRequest] = {}

    # ---------------------------------------------------------------- what the engine asks

    def reserving(self, request_id: str) -> bool:
        return request_id in self._reserved

    def forget_suspended(self, request_id: str) -> bool:
        """An abort of a suspended request: it is no longer suspended (the engine frees it). False if it was not."""
        return self._suspended.pop(request_id, None) is not None

    def held_blocks(self) -> int:
        """Blocks held by suspended and reserved requests (not by running ones)."""
        return sum(len(r.blocks) for r in self._suspended.values()) + sum(len(r.blocks) for r in self._reserved.values())

    def suspended(self) -> list[SimRequest]:
        return list(self._suspended.values())

    def clear(self) -> None:
        self._suspended.clear()
        self._reserved.clear()

    # ---------------------------------------------------------------- source

    def migration_view(self, request_id: str) -> MigrationView | None:
        req = self._table.running.get(request_id)
        if req is None:
            return None
        return MigrationView(block_ids=list(req.blocks), computed_tokens=req.prompt_len + req.generated)

    def migrating_request(self, request_id: str) -> MigratingRequest:
        req = self._table.by_id[request_id]
        # The sim derives tokens from the request id alone, so it needs no prompt ids; their count must travel
        # (and the ids themselves with a prefix cache: the destination names its blocks' content by them).
        prompt = req.tokens[:req.prompt_len] if req.tokens is not None else [0] * req.prompt_len
        return MigratingRequest(request_id=req.rid, prompt_token_ids=prompt, sampling=req.sampling,
                                reply_to="", priority=req.priority, arrival_time=req.arrival_time, max_total=req.max_total,
                                adapter=req.adapter[0], adapter_path=req.adapter[1], session=req.session,
                                retain_s=req.retain_s)

    def suspend(self, request_id: str) -> RequestState:
        req = self._table.running[request_id]
        self._table.unrun(req)
        self._suspended[request_id] = req
        # The sim's outputs are a function of (request id, index); only the count matters (and the ids, with
        # a prefix cache).
        outputs = req.tokens[req.prompt_len:] if req.tokens is not None else [0] * req.generated
        return RequestState(output_token_ids=outputs, emitted=req.generated)

    def resume(self, request_id: str) -> None:
        self._table.run(self._suspended.pop(request_id))

    def drop_migrated(self, request_id: str) -> None:
        req = self._suspended.pop(request_id)
        del self._table.by_id[request_id]
        self._blocks.release(req)

    # ---------------------------------------------------------------- destination

    def reserve(self, request: MigratingRequest, tokens: int) -> list[int]:
        rid = request.request_id
        req = self._reserved.get(rid)
        if req is None:
            incoming = check_incoming(request, rid in self._table.by_id, self._max_model_len)
            self._adapter(request)
            req = SimRequest(incoming, self._max_model_len)
            if self._blocks.cache is not None:
                req.tokens = list(request.prompt_token_ids)
        need = cdiv(tokens, self._block_size) - len(req.blocks)
        if need > 0:
            # Migration must not push this instance into preempting its own requests: keep the watermark.
            if not self._blocks.fits(need):
                if not req.blocks:
                    self._reserved.pop(rid, None)
                raise EngineError(f"no room: {need} more blocks wanted, {len(self._blocks)} free "
                                  f"(watermark {self._blocks.watermark:.0f})")
            req.blocks.extend(self._blocks.take(need))
        self._reserved[rid] = req
        return list(req.blocks)

    def commit(self, request_id: str, state: RequestState) -> None:
        req = self._reserved[request_id]
        generated = len(state.output_token_ids)
        if cdiv(req.prompt_len + generated, self._block_size) > len(req.blocks):
            raise EngineError(f"reservation of {len(req.blocks)} blocks cannot hold {req.prompt_len + generated} tokens")
        del self._reserved[request_id]
        req.generated = generated
        if req.tokens is not None:
            req.tokens = req.tokens[:req.prompt_len] + list(state.output_token_ids)
        self._table.by_id[request_id] = req
        self._table.run(req)  # with the priority it had on the source, admitted now

    def release(self, request_id: str) -> bool:
        req = self._reserved.pop(request_id, None)
        if req is None:
            return False
        self._blocks.release(req)
        return True

"""The sim engine: vLLM-like scheduling over a paged KV cache, with no model.

What it keeps from vLLM: a free list of KV blocks, append-only block tables, a waiting queue ordered by
priority (higher first; 1 = high, 0 = normal) and FCFS within a priority, continuous batching under
``max_num_seqs`` / ``max_num_batched_tokens`` / a free-block watermark, head-of-line blocking, and
preemption by recompute: the victim is the lowest-priority running request, the most recently admitted
among equals; it goes back to the front of its priority class and re-prefills its prompt plus the tokens
it already generated.

What it fakes: tokens and KV values are pure functions of the request id and the position, so they do
not depend on batch composition, preemption or which physical blocks a request got; the step time comes
from a latency model (``SimConfig``) and is returned for the daemon to wait out.

Token accounting: a step computes a request's input tokens and samples one token, and the sim stores the
sampled token's KV right away. So a running request that has generated ``g`` tokens has ``P + g`` computed
tokens (P = prompt length) and holds ``ceil((P + g) / block_size)`` blocks; a waiting request holds none.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import deque
from collections.abc import Iterator
from operator import attrgetter

import torch

from daemons.config import ModelConfig, SimConfig
from daemons.engine.base import (EngineError, EngineRequest, KvBlocks, MigrationView, StepResult, check_incoming,
                                  check_request)
from daemons.wire import InstanceLoad, MigratingRequest, RequestLoad, RequestState, TokenOut

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_GOLDEN = 0.6180339887498949  # spreads successive positions over [0, 1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _longs(values: list[int]) -> torch.Tensor:
    # torch.tensor(list) is ~10x slower than reading a buffer (no numpy here); values must be non-empty.
    return torch.frombuffer(array("q", values), dtype=torch.int64)


def _doubles(values: list[float]) -> torch.Tensor:
    return torch.frombuffer(array("d", values), dtype=torch.float64)


def _unit(data: bytes) -> float:
    """A float in [0, 1) from 8 bytes."""
    return int.from_bytes(data, "little") / 2.0**64


def kv_value(request_id: str, position: int, layer: int) -> tuple[float, float]:
    """The (K, V) scalar the sim stores for one token (before rounding to the KV dtype); for tests."""
    seed = _unit(hashlib.blake2b(request_id.encode(), digest_size=8).digest())
    x = (seed + position * _GOLDEN) % 1.0 + layer
    return x, -x


def _draw(request_id: str, index: int, vocab_size: int) -> tuple[int, float]:
    """(token id, EOS draw in [0, 1)) of output position ``index``: a function of the request alone."""
    digest = hashlib.blake2b(f"{request_id}:{index}".encode(), digest_size=16).digest()
    return 3 + int.from_bytes(digest[:8], "little") % (vocab_size - 3), _unit(digest[8:])


def sim_token_id(request_id: str, index: int, vocab_size: int) -> int:
    """The token a sim request emits at ``index`` unless it is EOS: lets tests check order and completeness."""
    return _draw(request_id, index, vocab_size)[0]


def sim_logprobs(request_id: str, index: int, token: int, k: int, vocab_size: int) -> tuple[float, list | None]:
    """The sim's logprob of the sampled ``token`` and its k alternatives (None for k = 0): deterministic, the
    sampled token first (the sim samples as if greedy), then ids token+1, token+2, ... one nat apart each."""
    digest = hashlib.blake2b(f"{request_id}:{index}:lp".encode(), digest_size=8).digest()
    logprob = -0.05 - 2.0 * _unit(digest)
    if not k:
        return logprob, None
    span = vocab_size - 3
    top = [(token, logprob)] + [(3 + (token - 3 + i) % span, logprob - i) for i in range(1, k)]
    return logprob, top


class _Req:
    __slots__ = ("rid", "prompt_len", "sampling", "priority", "arrival_time", "generated", "blocks",
                 "preempted", "seed", "stop_ids", "max_total")

    def __init__(self, request: EngineRequest, max_model_len: int):
        self.rid = request.request_id
        self.prompt_len = len(request.prompt_token_ids)
        self.sampling = request.sampling
        self.priority = request.priority
        self.arrival_time = request.arrival_time
        # A failover continues where another instance stopped: like a preempted request, it re-prefills the
        # prompt and what it generated (the sim's tokens depend on the request id and index alone).
        self.generated = len(request.output_token_ids)
        self.blocks: list[int] = []  # block table: append-only while running, emptied on preemption
        self.preempted = False
        self.seed = _unit(hashlib.blake2b(self.rid.encode(), digest_size=8).digest())
        self.stop_ids = frozenset(request.sampling.stop_token_ids)
        # The most tokens it can ever hold: it finishes on max_tokens or at the context limit.
        self.max_total = min(self.prompt_len + request.sampling.max_tokens, max_model_len)


class _Waiting:
    """Waiting requests: higher priority first, FCFS within a priority. One deque per priority that has
    waiting requests, so every verb but ``remove`` is O(1) while there are only a few priorities."""

    __slots__ = ("_classes", "_order", "_len", "tokens")

    def __init__(self):
        self._classes: dict[int, deque[_Req]] = {}
        self._order: list[int] = []  # priorities of the non-empty classes, highest first
        self._len = 0
        self.tokens = 0  # the tokens they will prefill (prompt and, if preempted, what they generated)

    def _class(self, priority: int) -> deque[_Req]:
        q = self._classes.get(priority)
        if q is None:
            q = self._classes[priority] = deque()
            self._order.append(priority)
            self._order.sort(reverse=True)
        return q

    def _drop_if_empty(self, priority: int) -> None:
        if not self._classes[priority]:
            del self._classes[priority]
            self._order.remove(priority)

    def append(self, req: _Req) -> None:
        """A new arrival: behind every waiting request of its priority."""
        self._class(req.priority).append(req)
        self._len += 1
        self.tokens += req.prompt_len + req.generated

    def appendleft(self, req: _Req) -> None:
        """A preempted request: it arrived before every waiting request of its priority."""
        self._class(req.priority).appendleft(req)
        self._len += 1
        self.tokens += req.prompt_len + req.generated

    def head(self) -> _Req:
        return self._classes[self._order[0]][0]

    def popleft(self) -> _Req:
        priority = self._order[0]
        req = self._classes[priority].popleft()
        self._drop_if_empty(priority)
        self._len -= 1
        self.tokens -= req.prompt_len + req.generated
        return req

    def remove(self, req: _Req) -> None:
        self._classes[req.priority].remove(req)  # O(its class), but aborts are rare next to steps
        self._drop_if_empty(req.priority)
        self._len -= 1
        self.tokens -= req.prompt_len + req.generated

    def clear(self) -> None:
        self._classes.clear()
        self._order.clear()
        self._len = 0
        self.tokens = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[_Req]:
        for priority in self._order:
            yield from self._classes[priority]


_priority = attrgetter("priority")


class SimEngine:
    backend = "sim"
    prefix_caching = False

    def __init__(self, sim: SimConfig, model: ModelConfig, kv: bool = True):
        """``kv`` False: no KV tensors (the virtual-time simulator, llumnixctl/experiments/simulate.py): the same
        scheduling, block accounting and step times, nothing written or copied."""
        self.cfg = sim
        self.block_size = sim.block_size
        self.max_model_len = model.max_model_len
        self.num_blocks = sim.num_blocks
        self._watermark_blocks = sim.watermark * sim.num_blocks
        dtype = _DTYPES[sim.kv_dtype]
        shape = (sim.num_blocks, 2, sim.block_size, sim.kv_heads, sim.head_dim)
        self.kv_caches: list[torch.Tensor] = [torch.zeros(shape, dtype=dtype) for _ in range(sim.kv_layers if kv else 0)]
        # Layer l stores (x + l, -(x + l)), so a copy that mixes up layers shows.
        self._layer_shift = [torch.tensor([l, -l], dtype=torch.float64)[None, :, None, None] for l in range(sim.kv_layers)]
        self._free: deque[int] = deque(range(sim.num_blocks))
        self._reqs: dict[str, _Req] = {}
        self._running: dict[str, _Req] = {}  # insertion order = admission order; change only via _run/_unrun
        self._running_per_priority: dict[int, int] = {}  # running requests by priority (no zero counts)
        self._waiting = _Waiting()
        self._suspended: dict[str, _Req] = {}  # migrating out: no steps, blocks kept
        self._reserved: dict[str, _Req] = {}  # migrating in: blocks held, not yet running
        self._kv_blocks: KvBlocks | None = None
        self._preemptions = 0
        self._received = 0
        self._tokens_generated = 0
        self._profile = None
        if sim.profile:
            from daemons.engine.profile import LatencyProfile, ProfileError

            try:
                self._profile = LatencyProfile.load(sim.profile)
            except ProfileError as exc:
                raise EngineError(f"sim.profile: {exc}") from None

    # ---------------------------------------------------------------- serving

    def add_request(self, request: EngineRequest) -> None:
        rid = request.request_id
        check_request(request, rid in self._reqs or rid in self._reserved, self.max_model_len)
        req = _Req(request, self.max_model_len)
        # A request that could never be (re)admitted would wait forever: refuse it now, like vLLM.
        peak = _cdiv(req.max_total, self.block_size)
        if self.num_blocks - peak < self._watermark_blocks:
            usable = int(self.num_blocks - self._watermark_blocks) * self.block_size
            raise EngineError(f"prompt plus max_tokens may reach {req.max_total} tokens; this instance's KV cache "
                              f"holds at most {usable} tokens per request; lower max_tokens or shorten the prompt")
        self._reqs[rid] = req
        self._waiting.append(req)
        self._received += 1

    def abort_request(self, request_id: str) -> bool:
        req = self._reqs.pop(request_id, None)
        if req is None:
            return False
        if request_id in self._running:
            self._unrun(req)
        elif self._suspended.pop(request_id, None) is None:
            self._waiting.remove(req)
        self._release(req)
        return True

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def step(self) -> StepResult:
        bs = self.block_size
        free = self._free
        # (1) Every running request computes one more token; make room, preempting from the tail. Higher
        # priorities go first (the sort is stable: admission order within a priority), so the tail is the
        # lowest-priority, most recently admitted request: a high one is preempted only when no normal
        # one is left. With one priority running (the usual case) admission order is already that order.
        run = list(self._running.values())
        if len(self._running_per_priority) > 1:
            run.sort(key=_priority, reverse=True)
        n = len(run)
        i = 0
        while i < n:
            req = run[i]
            if len(req.blocks) * bs == req.prompt_len + req.generated:
                while not free and n > i:
                    n -= 1
                    self._preempt(run[n])
                if n == i:  # it preempted itself
                    break
                req.blocks.append(free.popleft())
            i += 1
        decoding = run[:n]

        # (2) Admit in queue order (priority, then FCFS), stopping at the first request that does not fit
        # (head-of-line blocking). Not in a step that preempted, as in vLLM: the running requests are short
        # of blocks, and a waiting high-priority request that fits in what a victim freed would only cause
        # the next preemption.
        prefilling: list[_Req] = []
        prefill_tokens = 0
        waiting = self._waiting
        admit = n == len(run)
        while admit and waiting and len(self._running) < self.cfg.max_num_seqs:
            req = waiting.head()
            tokens = req.prompt_len + req.generated
            need = _cdiv(tokens + 1, bs)
            if len(free) - need < self._watermark_blocks:
                break
            if prefilling and prefill_tokens + tokens > self.cfg.max_num_batched_tokens:
                break
            waiting.popleft()
            req.blocks = [free.popleft() for _ in range(need)]
            req.preempted = False
            self._run(req)
            prefilling.append(req)
            prefill_tokens += tokens

        context_tokens = sum(r.prompt_len + r.generated for r in decoding)
        self._write_kv(decoding, prefilling)
        outputs = [self._sample(r) for r in decoding]
        outputs += [self._sample(r) for r in prefilling]
        self._tokens_generated += len(outputs)
        return StepResult(outputs=outputs, model_time_s=self._model_time(prefill_tokens, len(decoding), context_tokens))

    def load(self) -> InstanceLoad:
        used = self.num_blocks - len(self._free)
        head = self._waiting.head() if self._waiting else None
        return InstanceLoad(
            blocks_total=self.num_blocks,
            blocks_used=used,
            running=len(self._running),
            waiting=len(self._waiting),
            batch_size=self.cfg.max_num_seqs,
            block_size=self.block_size,
            preemptions=self._preemptions,
            hol_demand_blocks=_cdiv(head.prompt_len + head.generated + 1, self.block_size) if head else 0,
            requests_received=self._received,
            tokens_generated=self._tokens_generated,
            # Only running, suspended (migrating out) and reserved (migrating in) requests hold blocks.
            running_blocks=used - sum(len(r.blocks) for r in self._suspended.values())
            - sum(len(r.blocks) for r in self._reserved.values()),
            high_priority=sum(n for p, n in self._running_per_priority.items() if p > 0),
            waiting_tokens=self._waiting.tokens,
        )

    def requests(self) -> list[RequestLoad]:
        def row(r: _Req, state: str) -> RequestLoad:
            return RequestLoad(request_id=r.rid, state=state, blocks=len(r.blocks), prompt_tokens=r.prompt_len,
                               output_tokens=r.generated, priority=r.priority)

        out = [row(r, "running") for r in self._running.values()]
        out += [row(r, "migrating") for r in self._suspended.values()]
        out += [row(r, "preempted" if r.preempted else "waiting") for r in self._waiting]
        return out

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids in token order (empty while it waits). KeyError if unknown."""
        return list(self._reqs[request_id].blocks)

    # ---------------------------------------------------------------- migration, source

    def kv_blocks(self) -> KvBlocks:
        if self._kv_blocks is None:
            self._kv_blocks = KvBlocks(self.kv_caches, "sim", token_slots=True)
        return self._kv_blocks

    def migration_view(self, request_id: str) -> MigrationView | None:
        req = self._running.get(request_id)
        if req is None:
            return None
        return MigrationView(block_ids=list(req.blocks), computed_tokens=req.prompt_len + req.generated)

    def migrating_request(self, request_id: str) -> MigratingRequest:
        req = self._reqs[request_id]
        # The sim derives tokens from the request id alone, so it needs no prompt ids; their count must travel.
        return MigratingRequest(request_id=req.rid, prompt_token_ids=[0] * req.prompt_len, sampling=req.sampling,
                                reply_to="", priority=req.priority, arrival_time=req.arrival_time, max_total=req.max_total)

    def suspend(self, request_id: str) -> RequestState:
        req = self._running[request_id]
        self._unrun(req)
        self._suspended[request_id] = req
        # The sim's outputs are a function of (request id, index); only the count matters.
        return RequestState(output_token_ids=[0] * req.generated, emitted=req.generated)

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
            req = _Req(check_incoming(request, rid in self._reqs, self.max_model_len), self.max_model_len)
        need = _cdiv(tokens, self.block_size) - len(req.blocks)
        if need > 0:
            # Migration must not push this instance into preempting its own requests: keep the watermark.
            if len(self._free) - need < self._watermark_blocks:
                if not req.blocks:
                    self._reserved.pop(rid, None)
                raise EngineError(f"no room: {need} more blocks wanted, {len(self._free)} free "
                                  f"(watermark {self._watermark_blocks:.0f})")
            req.blocks.extend(self._free.popleft() for _ in range(need))
        self._reserved[rid] = req
        return list(req.blocks)

    def cached_blocks(self, request_id: str) -> int:
        return 0  # no prefix cache

    def prefix_hits(self, prompts: list[list[int]]) -> list[int]:
        return [0] * len(prompts)

    def commit(self, request_id: str, state: RequestState) -> None:
        req = self._reserved[request_id]
        generated = len(state.output_token_ids)
        if _cdiv(req.prompt_len + generated, self.block_size) > len(req.blocks):
            raise EngineError(f"reservation of {len(req.blocks)} blocks cannot hold {req.prompt_len + generated} tokens")
        del self._reserved[request_id]
        req.generated = generated
        self._reqs[request_id] = req
        self._run(req)  # with the priority it had on the source, admitted now

    def release(self, request_id: str) -> bool:
        req = self._reserved.pop(request_id, None)
        if req is None:
            return False
        self._release(req)
        return True

    def shutdown(self) -> None:
        self._suspended.clear()
        self._reserved.clear()
        self._reqs.clear()
        self._running.clear()
        self._running_per_priority.clear()
        self._waiting.clear()
        self._free = deque(range(self.num_blocks))
        self.kv_caches = []

    # ---------------------------------------------------------------- internals

    def _run(self, req: _Req) -> None:
        self._running[req.rid] = req
        self._running_per_priority[req.priority] = self._running_per_priority.get(req.priority, 0) + 1

    def _unrun(self, req: _Req) -> None:
        del self._running[req.rid]
        left = self._running_per_priority[req.priority] - 1
        if left:
            self._running_per_priority[req.priority] = left
        else:
            del self._running_per_priority[req.priority]

    def _release(self, req: _Req) -> None:
        self._free.extend(req.blocks)
        req.blocks = []

    def _preempt(self, req: _Req) -> None:
        self._unrun(req)
        self._release(req)
        req.preempted = True
        self._waiting.appendleft(req)
        self._preemptions += 1

    def _sample(self, req: _Req) -> TokenOut:
        index = req.generated
        sp = req.sampling
        token, eos_draw = _draw(req.rid, index, self.cfg.vocab_size)
        reason = None
        if index >= sp.min_tokens:
            if not sp.ignore_eos and eos_draw < self.cfg.eos_rate:
                token, reason = self.cfg.eos_token_id, "stop"
            elif token in req.stop_ids:
                reason = "stop"
        req.generated += 1
        if reason is None and (req.generated >= sp.max_tokens or req.prompt_len + req.generated >= self.max_model_len):
            reason = "length"
        if reason is not None:
            self._unrun(req)
            del self._reqs[req.rid]
            self._release(req)
        if sp.logprobs is None:
            return TokenOut(request_id=req.rid, index=index, token_id=token, finish_reason=reason)
        logprob, top = sim_logprobs(req.rid, index, token, sp.logprobs, self.cfg.vocab_size)
        return TokenOut(request_id=req.rid, index=index, token_id=token, finish_reason=reason, logprob=logprob, top=top)

    def _write_kv(self, decoding: list[_Req], prefilling: list[_Req]) -> None:
        """Store K and V of every token computed this step: one indexed write per layer.

        Each request contributes a run of positions: a decode the single position P + g (room was made in
        step (1)), a prefill positions 0 .. P + g (prompt, earlier output, and the token sampled now).
        """
        if (not decoding and not prefilling) or not self.kv_caches:
            return
        bs = self.block_size
        starts, lens, seeds, first_blk, blk_off, table = [], [], [], [], [], []
        for r in decoding:
            p = r.prompt_len + r.generated
            starts.append(p)
            lens.append(1)
            first_blk.append(p // bs)
            blk_off.append(len(table))
            table.append(r.blocks[p // bs])
            seeds.append(r.seed)
        for r in prefilling:
            starts.append(0)
            lens.append(r.prompt_len + r.generated + 1)
            first_blk.append(0)
            blk_off.append(len(table))
            table.extend(r.blocks)
            seeds.append(r.seed)
        if not prefilling:  # the common step: one token per request, no runs to expand
            positions, blocks, seed = _longs(starts), _longs(table), _doubles(seeds)
        else:
            n = _longs(lens)
            total = sum(lens)
            run_first = torch.cumsum(n, 0) - n  # each run's first index in the flat token list

            def per_token(t: torch.Tensor) -> torch.Tensor:
                return torch.repeat_interleave(t, n, output_size=total)

            positions = per_token(_longs(starts)) + torch.arange(total) - per_token(run_first)
            blocks = _longs(table)[per_token(_longs(blk_off)) + positions // bs - per_token(_longs(first_blk))]
            seed = per_token(_doubles(seeds))
        offsets = positions % bs
        x = torch.remainder(seed + positions.to(torch.float64) * _GOLDEN, 1.0)
        kv = torch.stack([x, -x], dim=1)[:, :, None, None]  # [tokens, 2 (K, V), 1, 1]: broadcast over heads
        for cache, shift in zip(self.kv_caches, self._layer_shift):
            # cache[blocks, :, offsets] has shape [tokens, 2, heads, head_dim]
            cache[blocks, :, offsets] = (kv + shift).to(cache.dtype)

    def _model_time(self, prefill_tokens: int, n_decoding: int, context_tokens: int) -> float:
        c = self.cfg
        if self._profile is not None:
            return c.time_scale * self._profile.step_ms(prefill_tokens, n_decoding, context_tokens) / 1000.0
        ms = 0.0
        if prefill_tokens > 0:
            ms += c.prefill_ms_per_token * prefill_tokens + c.prefill_ms
        if n_decoding > 0:
            ms += c.decode_ms_per_seq * n_decoding + c.decode_ms_per_token * context_tokens + c.decode_ms
        return c.time_scale * ms / 1000.0

"""The sim's tokens and KV values: pure functions of the request id and the position (daemons/engine/sim.py),
so that they do not depend on batch composition, preemption or which blocks a request got, and tests can
check order, completeness and migrated KV bytes."""

from __future__ import annotations

import hashlib
from array import array

import torch

from daemons.wire import TokenOut

GOLDEN = 0.6180339887498949  # spreads successive positions over [0, 1)


def _longs(values: list[int]) -> torch.Tensor:
    # torch.tensor(list) is ~10x slower than reading a buffer (no numpy here); values must be non-empty.
    return torch.frombuffer(array("q", values), dtype=torch.int64)


def _doubles(values: list[float]) -> torch.Tensor:
    return torch.frombuffer(array("d", values), dtype=torch.float64)


def unit(data: bytes) -> float:
    """A float in [0, 1) from 8 bytes."""
    return int.from_bytes(data, "little") / 2.0**64


def kv_value(request_id: str, position: int, layer: int) -> tuple[float, float]:
    """The (K, V) scalar the sim stores for one token (before rounding to the KV dtype); for tests."""
    seed = unit(hashlib.blake2b(request_id.encode(), digest_size=8).digest())
    x = (seed + position * GOLDEN) % 1.0 + layer
    return x, -x


def draw(request_id: str, index: int, vocab_size: int) -> tuple[int, float]:
    """(token id, EOS draw in [0, 1)) of output position ``index``: a function of the request alone."""
    digest = hashlib.blake2b(f"{request_id}:{index}".encode(), digest_size=16).digest()
    return 3 + int.from_bytes(digest[:8], "little") % (vocab_size - 3), unit(digest[8:])


def sim_token_id(request_id: str, index: int, vocab_size: int) -> int:
    """The token a sim request emits at ``index`` unless it is EOS: lets tests check order and completeness."""
    return draw(request_id, index, vocab_size)[0]


def sim_logprobs(request_id: str, index: int, token: int, k: int, vocab_size: int) -> tuple[float, list | None]:
    """The sim's logprob of the sampled ``token`` and its k alternatives (None for k = 0): deterministic, the
    sampled token first (the sim samples as if greedy), then ids token+1, token+2, ... one nat apart each."""
    digest = hashlib.blake2b(f"{request_id}:{index}:lp".encode(), digest_size=8).digest()
    logprob = -0.05 - 2.0 * unit(digest)
    if not k:
        return logprob, None
    span = vocab_size - 3
    top = [(token, logprob)] + [(3 + (token - 3 + i) % span, logprob - i) for i in range(1, k)]
    return logprob, top


def next_token(req, cfg, max_model_len: int) -> tuple[int, int, str | None]:
    """A running request's next token (sim_requests.SimRequest ``req``, counted in it): (index, token id, finish
    reason or None), by the sim's draws (``cfg``: SimConfig's vocab_size, eos_rate, eos_token_id)."""
    index = req.generated
    sp = req.sampling
    token, eos_draw = draw(req.rid, index, cfg.vocab_size)
    reason = None
    if index >= sp.min_tokens:
        if not sp.ignore_eos and eos_draw < cfg.eos_rate:
            token, reason = cfg.eos_token_id, "stop"
        elif token in req.stop_ids:
            reason = "stop"
    req.generated += 1
    if req.tokens is not None:
        req.tokens.append(token)
    if reason is None and (req.generated >= sp.max_tokens or req.prompt_len + req.generated >= max_model_len):
        reason = "length"
    return index, token, reason


def token_out(request_id: str, index: int, token: int, reason: str | None, logprobs: int | None,
              vocab_size: int) -> TokenOut:
    if logprobs is None:
        return TokenOut(request_id=request_id, index=index, token_id=token, finish_reason=reason)
    logprob, top = sim_logprobs(request_id, index, token, logprobs, vocab_size)
    return TokenOut(request_id=request_id, index=index, token_id=token, finish_reason=reason, logprob=logprob, top=top)


def write_kv(kv_caches: list[torch.Tensor], layer_shift: list[float], block_size: int, decoding: list,
             prefilling: list) -> None:
    """Store K and V of every token computed this step: one indexed write per layer.

    Each request contributes a run of positions: a decode the single position P + g (room was made in
    step (1)), a prefill positions 0 .. P + g (prompt, earlier output, and the token sampled now).
    """
    if (not decoding and not prefilling) or not kv_caches:
        return
    bs = block_size
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
    x = torch.remainder(seed + positions.to(torch.float64) * GOLDEN, 1.0)
    kv = torch.stack([x, -x], dim=1)[:, :, None, None]  # [tokens, 2 (K, V), 1, 1]: broadcast over heads
    for cache, shift in zip(kv_caches, layer_shift):
        # cache[blocks, :, offsets] has shape [tokens, 2, heads, head_dim]
        cache[blocks, :, offsets] = (kv + shift).to(cache.dtype)

"""The sim engine's KV bytes: a pure function of the request and the position, whatever blocks it got, its
neighbours, or a preemption and re-prefill in between (what migrations are checked against)."""

from __future__ import annotations

import pytest
import torch

from daemons.engine.sim import SimEngine, kv_value
from tests.unit.test_sim_engine import engine, req, states


def request_kv(e: SimEngine, rid: str) -> list[torch.Tensor]:
    """The request's computed K/V slots, in token order, per layer: [tokens, 2, heads, head_dim]."""
    row = next(r for r in e.requests() if r.request_id == rid)
    n = row.prompt_tokens + row.output_tokens
    table = torch.tensor(e.block_table(rid))
    pos = torch.arange(n)
    return [cache[table[pos // e.block_size], :, pos % e.block_size] for cache in e.kv_caches]


def expected_kv(rid: str, n: int, layers: int, shape: tuple[int, int], dtype: torch.dtype) -> list[torch.Tensor]:
    out = []
    for layer in range(layers):
        values = torch.tensor([list(kv_value(rid, p, layer)) for p in range(n)], dtype=torch.float64)
        out.append(values[:, :, None, None].expand(n, 2, *shape).to(dtype))
    return out


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_kv_content_is_a_function_of_the_request(dtype):
    alone = engine(block_size=4, num_blocks=32, kv_dtype=dtype)
    alone.add_request(req("x", 6, max_tokens=40))
    for _ in range(7):
        alone.step()
    mine = request_kv(alone, "x")
    assert len(mine) == 2 and mine[0].shape == (13, 2, 2, 4) and mine[0].dtype == getattr(torch, dtype)
    assert all(torch.equal(a, b) for a, b in zip(mine, expected_kv("x", 13, 2, (2, 4), mine[0].dtype)))

    # Other blocks, a neighbour, and a preemption with re-prefill in between: the same bytes.
    crowd = engine(block_size=4, num_blocks=12, kv_dtype=dtype)
    crowd.add_request(req("y", 9, max_tokens=30))
    crowd.step()
    crowd.add_request(req("x", 6, max_tokens=40))
    while not (crowd.load().preemptions and states(crowd).get("x") == "running"):
        crowd.step()
        assert crowd.load().tokens_generated < 200
    theirs = request_kv(crowd, "x")
    assert len(theirs[0]) > 13 and crowd.block_table("x")[:4] != alone.block_table("x")
    assert all(torch.equal(a[:13], b) for a, b in zip(theirs, mine))
    assert all(torch.equal(a, b) for a, b in zip(theirs, expected_kv("x", len(theirs[0]), 2, (2, 4), mine[0].dtype)))
    assert not torch.equal(mine[0], mine[1])  # layers differ
    other = engine(block_size=4, num_blocks=32, kv_dtype=dtype)
    other.add_request(req("z", 6, max_tokens=40))
    for _ in range(7):
        other.step()
    assert not torch.equal(request_kv(other, "z")[0], mine[0])  # another request stores other bytes

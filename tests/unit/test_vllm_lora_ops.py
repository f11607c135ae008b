"""vllm_internals.leave_rows_without_adapter on vLLM's own PyTorch LoRA ops (the CPU backend's): a token without
an adapter (index -1) keeps its row as it was, where vLLM's op took the last slot's adapter for it; the tokens with
an adapter get what vLLM's op gives them. (The engine runs them in tests/e2e/test_vllm_real_model.py.)"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
from vllm.lora.ops.torch_ops import lora_ops  # noqa: E402
from vllm.lora.punica_wrapper import punica_cpu  # noqa: E402

from daemons.engine.vllm_internals import leave_rows_without_adapter  # noqa: E402

SLOTS, RANK, HIDDEN = 2, 4, 8
INDICES = torch.tensor([-1, 0, 1, -1, 1])  # tokens of the base model, of slot 0's adapter, of slot 1's
NONE, SOME = INDICES < 0, INDICES >= 0


def _applied(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Each token's row times its slot's weights (what a token with an adapter gets)."""
    return torch.einsum("bi, boi -> bo", x, w[INDICES.clamp(min=0), 0])


def test_tokens_without_an_adapter_keep_their_rows_and_the_others_get_their_adapter():
    leave_rows_without_adapter()
    leave_rows_without_adapter()  # idempotent
    # vLLM's V1 runner calls the sgmv ops, which call the bgmv ones by name: both see the wrapped ones
    assert lora_ops.bgmv_expand is punica_cpu.bgmv_expand and lora_ops.bgmv_shrink is punica_cpu.bgmv_shrink
    g = torch.Generator().manual_seed(0)
    x, h = torch.randn(5, HIDDEN, generator=g), torch.randn(5, RANK, generator=g)
    a, b = torch.randn(SLOTS, 1, RANK, HIDDEN, generator=g), torch.randn(SLOTS, 1, HIDDEN, RANK, generator=g)
    before = torch.randn(5, HIDDEN, generator=g)

    shrunk = torch.full((5, RANK), 7.0)
    lora_ops.sgmv_shrink(x, a, shrunk, None, torch.ones(5, dtype=torch.long), INDICES, 5, 1, 5, 0.5)
    assert (shrunk[NONE] == 7.0).all()
    assert torch.allclose(shrunk[SOME], 0.5 * _applied(x, a)[SOME])

    expanded = before.clone()
    lora_ops.sgmv_expand(h, b, expanded, None, torch.ones(5, dtype=torch.long), INDICES, 5, 1, 5, add_inputs=True)
    assert torch.equal(expanded[NONE], before[NONE])  # vLLM's op added the last slot's adapter here
    assert torch.allclose(expanded[SOME], before[SOME] + _applied(h, b)[SOME])

    sliced = before.clone()
    punica_cpu.bgmv_expand_slice(h, b[:, :, :4], sliced, INDICES, 2, 4, True)
    assert torch.equal(sliced[NONE], before[NONE])
    assert torch.allclose(sliced[SOME][:, 2:6], before[SOME][:, 2:6] + _applied(h, b[:, :, :4])[SOME])
    assert torch.equal(sliced[SOME][:, :2], before[SOME][:, :2]) and torch.equal(sliced[SOME][:, 6:], before[SOME][:, 6:])

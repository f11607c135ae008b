"""Per-layer KV views in each of vLLM's KV cache layouts, built from the layout's stride order alone.

vLLM's ``KVCacheLayout`` names a physical order of the logical axes ``[L, B, H, N, C]`` (layers, blocks,
heads, token slots, channels); its allocator makes one backing buffer in that order and hands each layer the
view ``[B, H, N, C]``. ``layout_views`` does the same on any device without importing vLLM, so the KV copy
paths can be checked on a GPU node whose Python has torch but no vLLM of the version we pin (and
tests/unit/test_kv_devices.py checks that these views have vLLM's own strides where vLLM imports).
"""

from __future__ import annotations

import torch

# name -> stride order: physical axis i holds logical axis ORDERS[name][i] (vLLM 0.32's KVCacheLayout values)
ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def layout_views(name: str, layers: int, blocks: int, heads: int, tokens: int, channels: int,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                 seed: int = 0) -> list[torch.Tensor]:
    """``layers`` views ``[blocks, heads, tokens, channels]`` of one buffer laid out as ``name`` says,
    filled with random bytes (every byte of the buffer, so a copy that reads or writes a wrong byte shows)."""
    order = ORDERS[name]
    logical = (layers, blocks, heads, tokens, channels)
    physical = tuple(logical[i] for i in order)
    nbytes = dtype.itemsize
    for d in physical:
        nbytes *= d
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).to(device)
    buf = raw.view(dtype).view(physical)
    inverse = tuple(order.index(axis) for axis in range(5))  # where each logical axis sits physically
    view = buf.permute(*inverse)
    return [view[i] for i in range(layers)]

"""A real Gloo pair on loopback, both ends in this process: what the KV copy tests and scripts/kv-bench.py move
blocks over (daemons/kv/transfer.py ``Pair``, its source end holding the TCPStore its destination end joins)."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from daemons.kv.transfer import DEST_RANK, SOURCE_RANK, Pair


def loopback_pair(key: str, timeout_s: float = 30) -> tuple[Pair, Pair]:
    """(source, destination); the caller closes both."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout, use_libuv=True)
    src = Pair(key, "127.0.0.1", SOURCE_RANK, store, timeout_s)
    dst = Pair(key, "127.0.0.1", DEST_RANK,
               lambda: dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timeout, use_libuv=True),
               timeout_s)
    return src, dst

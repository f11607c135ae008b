"""``vllm.rank_spin_s``: the waits on a tensor-parallel engine's shared-memory queues spin that long, then sleep
until the writer signals (daemons/engine/vllm_internals.py ``rank_waits``). On a contended host the llumlet's
step thread spun for the whole of every step at normal priority, taking the cores its ranks (and the llumlet's
own event loop) needed."""

from __future__ import annotations

import pytest

shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")

from daemons.engine.vllm_internals import VllmInternals  # noqa: E402


def test_readers_spin_for_the_setting_then_sleep():
    cls = shm_broadcast.SpinCondition
    original = getattr(cls.__init__, "llumnix_original", cls.__init__)
    made = []

    def init(self, is_reader, context, notify_address, busy_loop_s=1):  # vLLM's signature, recorded
        made.append((is_reader, notify_address, busy_loop_s))

    cls.__init__ = init
    try:
        VllmInternals.rank_waits(0.0)
        VllmInternals.rank_waits(0.25)  # again: the latest wins, nothing is wrapped twice
        assert cls.__init__.llumnix_original is init
        cls(is_reader=True, context=None, notify_address="ipc://x")  # as vLLM makes its readers: by keyword
        cls(False, None, "ipc://y")
    finally:
        cls.__init__ = original
    assert made == [(True, "ipc://x", 0.25), (False, "ipc://y", 0.25)]

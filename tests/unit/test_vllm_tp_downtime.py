"""What a tensor-parallel instance asks of its ranks inside a migration's downtime (daemons/engine/
vllm_internals_migration.py ``VllmMoves``), on vLLM's own ``Request`` and ``SamplingParams`` with the executor's
``collective_rpc`` recorded: the source asks for a sampler's state only when the request is seeded, the
destination's commit is sent without waiting for the ranks, and a rank's failure to take it is logged.
That the ranks take the commit before the request's first step is checked end to end, at TP 2, by
tests/e2e/test_e2e_vllm_tp.py (a rank without it fails that step)."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from daemons.engine.vllm_internals import VllmInternals  # noqa: E402
from daemons.engine.vllm_internals_migration import VllmMoves  # noqa: E402
from daemons.engine.vllm_internals_state import VllmState  # noqa: E402

BLOCKS = [3, 4]


class Executor:
    """vLLM's multiprocess executor as the engine sees it: ``collective_rpc`` answers every rank (blocking) or
    returns a future (``non_block``); each call is recorded."""

    def __init__(self, ranks: int = 2):
        self.ranks = ranks
        self.calls: list[tuple[str, bool]] = []
        self.sent: list[Future] = []

    def collective_rpc(self, method: str, args=(), non_block: bool = False, **_):
        self.calls.append((method, non_block))
        answers = [f"rank{r}-{method}".encode() for r in range(self.ranks)]
        if not non_block:
            return answers
        future = Future()
        self.sent.append(future)
        return future


def _moves(executor: Executor) -> tuple[VllmMoves, SimpleNamespace]:
    scheduler = SimpleNamespace(running=[], requests={}, finished_req_ids=set(),
                                kv_cache_manager=SimpleNamespace(block_pool=None,
                                                                 get_block_ids=lambda rid: (list(BLOCKS),)))
    core = SimpleNamespace(scheduler=scheduler, model_executor=executor)
    config = SimpleNamespace(model_config=None, parallel_config=SimpleNamespace(tensor_parallel_size=executor.ranks),
                             cache_config=SimpleNamespace(enable_prefix_caching=False))
    return VllmMoves(VllmState(VllmInternals.import_checked(), core, config)), scheduler


def _request(rid: str, **sampling) -> Request:
    return Request(rid, list(range(40)), SamplingParams(max_tokens=16, **sampling), None)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8}], ids=["greedy", "random-unseeded"])
def test_an_unseeded_request_is_suspended_without_asking_the_ranks(sampling):
    executor = Executor()
    moves, scheduler = _moves(executor)
    req = _request("a", **sampling)
    scheduler.running.append(req)
    assert moves.suspend(req) == b"" and executor.calls == []
    assert req not in scheduler.running


def test_a_seeded_request_takes_rank_0s_sampler_state():
    executor = Executor()
    moves, scheduler = _moves(executor)
    req = _request("s", temperature=0.8, seed=7)
    scheduler.running.append(req)
    assert moves.suspend(req) == b"rank0-llumnix_generator_state"
    assert executor.calls == [("llumnix_generator_state", False)]


def test_the_commit_is_sent_to_the_ranks_without_waiting_and_the_request_runs():
    executor = Executor()
    moves, scheduler = _moves(executor)
    req = _request("c", temperature=0)
    moves.commit(req, [11, 12, 13], b"")
    assert executor.calls == [("llumnix_commit", True)]
    assert scheduler.running == [req] and scheduler.requests == {"c": req}
    assert req.num_computed_tokens == 40 + 3 - 1 and list(req.output_token_ids) == [11, 12, 13]
    executor.sent[0].set_result([None, None])  # the ranks' answers, read before the next step's


def test_a_rank_that_fails_to_take_the_commit_is_logged(caplog):
    executor = Executor()
    moves, _ = _moves(executor)
    moves.commit(_request("f", temperature=0), [11], b"")
    with caplog.at_level(logging.ERROR, logger="llumnix.engine.vllm"):
        executor.sent[0].set_exception(RuntimeError("Worker failed with error 'boom'"))
    assert any("f's runner state" in r.getMessage() and "boom" in r.getMessage() for r in caplog.records)

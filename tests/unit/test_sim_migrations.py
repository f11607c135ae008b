"""The sim engine's migration part on its own: SimEngineMigrations over a request table and a free list."""

import pytest

from daemons.engine.base import EngineError, EngineRequest
from daemons.engine.sim_migration import SimEngineMigrations
from daemons.engine.sim_requests import SimRequestTable, SimBlocks, SimRequest
from daemons.wire import MigratingRequest, RequestState, SamplingParams

BS = 4


def parts(num_blocks: int = 10, watermark: float = 0.0):
    table, blocks = SimRequestTable(), SimBlocks(num_blocks, watermark, None)
    return table, blocks, SimEngineMigrations(table, blocks, BS, 1024)


def running(table: SimRequestTable, blocks: SimBlocks, rid: str, prompt: int, generated: int) -> SimRequest:
    req = SimRequest(EngineRequest(rid, [1] * prompt, SamplingParams(max_tokens=50)), 1024)
    req.generated = generated
    req.blocks = blocks.take_for_prefill(-(-(prompt + generated) // BS))
    table.by_id[rid] = req
    table.run(req)
    return req


def incoming(rid: str, prompt: int) -> MigratingRequest:
    return MigratingRequest(request_id=rid, prompt_token_ids=[0] * prompt, sampling=SamplingParams(max_tokens=50),
                            reply_to="", max_total=prompt + 50)


def test_suspend_keeps_the_blocks_out_of_the_running_set_and_resume_puts_it_back():
    table, blocks, mig = parts()
    req = running(table, blocks, "a", 6, 3)
    assert mig.migration_view("a").computed_tokens == 9 and mig.migration_view("a").block_ids == req.blocks
    assert mig.suspend("a").emitted == 3
    assert "a" not in table.running and mig.migration_view("a") is None
    assert mig.held_blocks() == 3 and [r.rid for r in mig.suspended()] == ["a"]
    mig.resume("a")
    assert list(table.running) == ["a"] and mig.held_blocks() == 0


def test_drop_migrated_frees_the_blocks_and_forgets_the_request():
    table, blocks, mig = parts()
    running(table, blocks, "a", 6, 3)
    mig.suspend("a")
    mig.drop_migrated("a")
    assert len(blocks) == 10 and "a" not in table.by_id and mig.held_blocks() == 0


def test_reserve_grows_commit_runs_release_frees():
    table, blocks, mig = parts()
    assert len(mig.reserve(incoming("b", 5), 5)) == 2 and mig.reserving("b")
    assert len(mig.reserve(incoming("b", 5), 9)) == 3 and len(blocks) == 7
    with pytest.raises(EngineError, match="cannot hold"):
        mig.commit("b", RequestState(output_token_ids=[0] * 8, emitted=8))
    mig.commit("b", RequestState(output_token_ids=[0] * 4, emitted=4))
    assert list(table.running) == ["b"] and table.by_id["b"].generated == 4 and not mig.reserving("b")
    assert mig.reserve(incoming("c", 5), 5) and mig.release("c") and len(blocks) == 7
    assert not mig.release("c")


def test_reserve_keeps_the_watermark_and_drops_an_empty_reservation():
    table, blocks, mig = parts(num_blocks=10, watermark=4.0)
    with pytest.raises(EngineError, match="no room"):
        mig.reserve(incoming("b", 25), 25)  # 7 blocks would leave 3 < 4
    assert not mig.reserving("b") and len(blocks) == 10

"""The simulator's migrations (llumnixctl/experiments/simulate.py): the source's request selection and the
stage plan are the daemons' own (daemons/instance/selection.py, daemons/stages.py); copies and messages take
the virtual time the ``Network`` says."""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

from daemons import stages, wire

if TYPE_CHECKING:
    from llumnixctl.experiments.simulate import SimulatedInstance


def engine_error() -> type[Exception]:
    from daemons.engine.base import EngineError  # (torch: only once a simulation runs)

    return EngineError


class MigrationMixin:
    """Of the Simulation: runs the manager's orders as the daemons would, stage by stage."""

    def _order(self, src: SimulatedInstance, start: wire.MigrateStart) -> None:
        from daemons.instance import keep_for, migrants_for  # (torch: only once a simulation runs)

        keep = keep_for(start, src.migrating, src.arrived, self.now)
        chosen = migrants_for(start, src.engine.requests(), keep, src.engine.load(), src.engine.block_size)
        moving = [c.request_id for c in chosen if not c.redispatch]
        for c in chosen:
            if c.redispatch:  # a queued request goes back through dispatch
                src.engine.abort_request(c.request_id)
                self._changed(src)
                self.at(self.now + self.net.message_s, self._arrive, c.request_id, (src.iid,))
        self._maybe_gone(src)
        unused = start.count - len(moving)
        if unused > 0:
            self.mgr.resched.count_orders(src.iid, start.dst, -unused)
        for rid in moving:
            self._migrate(src, self.instances[start.dst], rid, start.reason)

    def _migrate(self, src: SimulatedInstance, dst: SimulatedInstance, rid: str, reason: str) -> None:
        mig = SimpleNamespace(src=src, dst=dst, rid=rid, reason=reason, stage=0, sent=0, reserved=False,
                              request=src.engine.migrating_request(rid), started=self.now)
        src.migrating.add(rid)
        dst.migrating.add(rid)
        self._stage(mig)

    def _block_s(self, blocks: int) -> float:
        bs = self.cfg.sim.block_size
        gbps = self.net.kv_gbps
        cap = self.cfg.migration.bandwidth_limit_mbps * 8e6
        rate = min(gbps * 1e9, cap) if cap > 0 else gbps * 1e9
        return blocks * bs * self.kv_bytes_per_token * 8 / rate

    def _stage(self, mig) -> None:
        """One pre-copy stage, or the last one: as daemons/migration/ runs them."""
        src, dst = mig.src, mig.dst
        view = src.engine.migration_view(mig.rid)
        if view is None:
            return self._end(mig, "aborted", "the request finished or was preempted on the source")
        bs = src.engine.block_size
        mc = self.cfg.migration
        if stages.is_last(view.computed_tokens, mig.sent, mig.stage, bs, mc.last_stage_max_blocks, mc.max_stages):
            src.boundary.append(lambda: self._last_stage(mig))
            return self._kick(src)
        planned = stages.plan(view.computed_tokens, mig.sent, False, bs, mc.last_stage_max_blocks,
                              mig.request.max_total)
        try:
            dst.engine.reserve(mig.request, planned.tokens)
        except engine_error() as exc:
            return self._end(mig, "aborted", f"the destination refused: {exc}")
        mig.reserved = True
        mig.sent = planned.upto
        mig.stage += 1
        self.at(self.now + 2 * self.net.message_s + self._block_s(planned.n_blocks), self._stage, mig)

    def _last_stage(self, mig) -> None:
        src, dst = mig.src, mig.dst
        view = src.engine.migration_view(mig.rid)
        if view is None:
            return self._end(mig, "aborted", "the request finished or was preempted before the last stage")
        state = src.engine.suspend(mig.rid)
        planned = stages.plan(view.computed_tokens, mig.sent, True, src.engine.block_size,
                              self.cfg.migration.last_stage_max_blocks, mig.request.max_total)
        try:
            dst.engine.reserve(mig.request, planned.tokens)
        except engine_error() as exc:
            src.engine.resume(mig.rid)
            return self._end(mig, "aborted", f"the destination refused the last stage: {exc}")
        mig.reserved = True
        # one round trip: the blocks, then the commit
        downtime = 2 * self.net.message_s + self._block_s(planned.n_blocks)
        self.at(self.now + downtime, self._commit, mig, state, downtime)

    def _commit(self, mig, state, downtime: float) -> None:
        src, dst = mig.src, mig.dst
        dst.engine.commit(mig.rid, state)
        src.engine.drop_migrated(mig.rid)
        self.requests[mig.rid].owner = dst.iid
        dst.arrived[mig.rid] = self.now
        self.downtimes.append(downtime)
        self._end(mig, "committed", "")
        self._kick(dst)

    def _end(self, mig, outcome: str, why: str) -> None:
        src, dst = mig.src, mig.dst
        if outcome != "committed" and mig.reserved:
            dst.engine.release(mig.rid)
        src.migrating.discard(mig.rid)
        dst.migrating.discard(mig.rid)
        self.mgr.resched.count_orders(src.iid, dst.iid, -1)
        self.outcomes[f"{mig.reason or 'operator'}/{outcome}"] += 1
        if why:
            self.outcomes[f"aborted: {why.split(':')[0]}"] += 1
        for inst in (src, dst):
            self._changed(inst)
            self._kick(inst)
        self._notify("migration", src=src.iid, dst=dst.iid, request=mig.rid, outcome=outcome, reason=mig.reason,
                     started=mig.started, why=why)
        self._maybe_gone(src)

"""The simulator runs the daemons' own objects for every decision (issue #51): each simulated instance's step
loop, mailbox, intake, handovers and migration orders are the instance daemon's; the manager's ``Roles`` chooses
every handover's destination; no copy of them is left in llumnixctl/experiments/sim/."""

from __future__ import annotations

import inspect

from daemons.config import load_config
from daemons.instance.handover import Handovers
from daemons.instance.intake import Intake
from daemons.instance.mailbox import Mailbox
from daemons.instance.selection import Orders
from daemons.instance.steps import StepLoop
from daemons.manager.roles import Roles
from llumnixctl.experiments.sim import disagg, llumlet, migrate, parts, simulate
from llumnixctl.experiments.sim.simulate import Simulation
from llumnixctl.experiments.traces import gen as trace

SMALL = ["sim.num_blocks=1200", "sim.max_num_seqs=32", "instance.log_level=warning"]


def test_every_handover_is_chosen_by_the_managers_roles_and_run_by_the_instances_orders(monkeypatch):
    offers, orders = [], []
    on_handover, migrate_command = Roles.on_handover, Orders.migrate_command

    def counted(self, msg):
        offers.append(msg)
        return on_handover(self, msg)

    async def ordered(self, msg):
        orders.append((self.ident.instance_id, msg, self.max_in_flight))
        return await migrate_command(self, msg)

    monkeypatch.setattr(Roles, "on_handover", counted)
    monkeypatch.setattr(Orders, "migrate_command", ordered)
    cfg = load_config(None, SMALL + ["migration.max_in_flight=3", "disagg.handover_precopy=false"])
    reqs = trace.generate(30, rate=3.0, arrival="poisson", cv=1.0, prompt=(600, 2000), output=(20, 60), alpha=1.0,
                          high_fraction=0.0, seed=3)
    sim = Simulation(cfg, 3, reqs, roles=["prefill", "decode", "decode"])
    res = sim.run()
    assert res["completed"] == 30 and res["leaked_blocks"] == 0
    committed = res["disagg"]["handovers"]["handover/committed"]
    assert committed > 0 and len(offers) >= committed
    handovers = [(src, m) for src, m, _ in orders if m.reason == "handover"]
    assert len(handovers) >= committed and all(src == "i0" for src, _ in handovers)
    assert all(m.blocking for _, m in handovers)  # disagg.handover_precopy = false, as the manager says it
    assert {n for _, _, n in orders} == {3}  # the instance's own in-flight bound
    inst = sim.instances["i1"]
    for part, cls in ((inst.mailbox, Mailbox), (inst.stepper, StepLoop), (inst.intake, Intake),
                      (inst.handovers, Handovers), (inst.orders, Orders)):
        assert type(part) is cls
    assert inst.orders.max_in_flight == 3 and inst.handovers.lease_s == cfg.disagg.handover_lease_s


def test_no_copy_of_a_daemon_decision_is_left_in_the_simulator():
    """What the simulator once copied (handover choice and its ledger, the instance's selection, the step loop and
    its boundary, the adaptive rule's and scale-out's role choice) is named nowhere in it."""
    source = "".join(inspect.getsource(m) for m in (disagg, llumlet, migrate, parts, simulate))
    for name in ("handover_destination", "handover_blocks", "_with_incoming", "migrants_for", "keep_for",
                 "disagg.adapt(", "short_role", "run_boundary", "at_boundary", "_step_done", "engine.step()",
                 "count_orders", "Network(handover"):
        assert name not in source, name

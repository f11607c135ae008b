"""Prefill/decode set-up off the request path, the manager's side (daemons/manager/handover_links.py): each
prefill instance is told (wire.PeerLink) to link to every decode or mixed instance when either joins or takes
its role, once per pair of processes; a decode instance with a smaller tensor-parallel size than a prefill
instance's is refused when the second of the two joins, with both sizes named."""

from __future__ import annotations

from daemons import wire
from daemons.links import DOWN
from daemons.manager.handover_links import tp_refusal, wanted
from daemons.manager.records import InstanceRecord
from tests.support.manager import Bench, _fields, capture, load


def spec(tp: int) -> str:
    return f"engine=sim;layout=block-major;layers=2;block=2x16x2x16;dtype=float16;tp={tp}"


def rec(iid: str, role: str, tp: int = 1, state: str = "alive") -> InstanceRecord:
    info = wire.Register(iid, "h", 1, f"tcp://127.0.0.1:{7000 + int(iid[1:])}", "sim", "m", load(role=role),
                         kv_spec=spec(tp))
    return InstanceRecord(info=info, identity=iid.encode(), load=info.load, last_seen=0.0, state=state)


def test_every_live_prefill_instance_links_to_every_decode_or_mixed_one_and_only_with_roles():
    recs = [rec("i0", "prefill"), rec("i1", "decode"), rec("i2", "mixed"), rec("i3", "prefill"),
            rec("i4", "decode", state="dead")]
    assert wanted(recs) == {("i0", "i1"), ("i0", "i2"), ("i3", "i1"), ("i3", "i2")}
    assert wanted([rec("i0", "mixed"), rec("i1", "mixed")]) == set()  # no roles: no links made ahead
    assert wanted([rec("i0", "prefill")]) == set()


def test_a_decode_tp_smaller_than_a_prefill_tp_is_refused_whichever_joins_second():
    prefill2, decode1 = rec("i0", "prefill", tp=2), rec("i1", "decode", tp=1)
    why = tp_refusal(decode1.info, [prefill2])
    assert "decode instance i1 has tensor-parallel size 1, smaller than prefill instance i0's 2" in why, why
    assert "vllm.tensor_parallel_size" in why
    assert "refused" in tp_refusal(prefill2.info, [decode1])  # the prefill one joining second
    assert tp_refusal(rec("i2", "decode", tp=2).info, [prefill2]) == ""
    assert tp_refusal(rec("i2", "decode", tp=4).info, [prefill2]) == ""  # larger is not refused here
    assert tp_refusal(rec("i2", "mixed", tp=1).info, [prefill2]) == ""
    assert tp_refusal(decode1.info, [rec("i0", "prefill", tp=2, state="dead")]) == ""


def test_the_manager_tells_prefill_instances_their_targets_once_per_process_and_refuses_a_small_decode(caplog):
    log = capture(caplog)

    async def scenario(b: Bench):
        links = b.m.handover_links
        p = b.instance("i0", role="prefill", told={"kv_spec": spec(2)})
        d = b.instance("i1", role="decode", told={"kv_spec": spec(2)})
        m = b.instance("i2", role="mixed")
        assert links.check() == 2 and links.check() == 0  # told once
        told = [(x.instance_id, x.request_address) for x in b.wire.sent(p.ident, wire.PeerLink)]
        assert sorted(told) == [("i1", d.address), ("i2", m.address)]
        assert not b.wire.sent(d.ident, wire.PeerLink) and not b.wire.sent(m.ident, wire.PeerLink)
        # A decode instance with a smaller TP joining is refused, for good, naming both sizes.
        small = wire.Register("i3", "h", 9, "tcp://127.0.0.1:7003", "sim", "m", load(role="decode"),
                              kv_spec=spec(1))
        ack = b.m.on_register(b"sock-i3", small)
        assert not ack.accepted and ack.final and "tensor-parallel size 1, smaller than prefill instance i0's 2" \
            in ack.reason, ack
        assert "i3" not in b.m.instances
        # The prefill instance dies and restarts (a new process): told again.
        b.links.set("i0", DOWN)
        assert b.state("i0") == "dead" and links.check() == 0
        b.restart(p)
        ack = b.m.on_register(p.ident, wire.Register(**{**_fields(p.register_msg()), "pid": 4242,
                                                       "kv_spec": spec(2)}))
        assert ack.accepted, ack
        assert links.check() == 2

    Bench.run(scenario)
    assert "prefill instance i0: make the links to i1 now" in log()


def test_a_role_change_that_would_put_a_smaller_tp_decode_beside_a_larger_prefill_is_refused():
    from daemons.config import Config
    from daemons.manager.roles import Roles
    from daemons.manager.shared import Shared

    class View:
        def __init__(self, recs):
            self.instances = {r.instance_id: r for r in recs}

        def get(self, iid):
            return self.instances.get(iid)

        def records(self):
            return self.instances.values()

        def set_role(self, r, role):
            r.load = wire.InstanceLoad(**{**_fields(r.load), "role": role})

    sent = []
    view = View([rec("i0", "prefill", tp=2), rec("i1", "mixed", tp=1), rec("i2", "mixed", tp=2)])
    roles = Roles(Shared(Config(), view, None, None, lambda r, m: sent.append((r.instance_id, m)), None), None)
    reply = roles.on_role(wire.RoleQuery(1, "i1", "decode"))
    assert isinstance(reply, wire.ErrorReply) and "role decode for i1 refused" in reply.message, reply
    assert "tensor-parallel size 1, smaller than prefill instance i0's 2" in reply.message
    assert not sent and view.get("i1").load.role == "mixed"
    reply = roles.on_role(wire.RoleQuery(2, "i2", "decode"))
    assert isinstance(reply, wire.RoleReply) and reply.role == "decode" and sent == [("i2", wire.SetRole("decode", "operator"))]

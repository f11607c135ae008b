"""LoRA adapters without an engine: the adapter table (slots, LRU that keeps adapters with running requests, unload
deferred past running requests), the checks before a load (path, rank, shapes against the model), residency in
dispatch (holders first, loading elsewhere when they are hot, the replica bound, composed in ``policy.place``), the
prefix keys of an adapter's blocks, the settings, the proxy's model check and the manager's catalogue."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from types import SimpleNamespace

import pytest
from hypothesis import given, strategies as st

from daemons import policy, prefix, wire
from daemons.config import ConfigError, load_config, parse_adapters
from daemons.engine.adapters import AdapterTable, check_adapter_dir, check_shapes, module_dims
from daemons.engine.base import EngineError
from daemons.policy.residency import adapter_pool
from daemons.policy.usage import InstanceState

# ------------------------------------------------------------------ the adapter table


def test_a_free_slot_is_taken_before_anything_is_unloaded():
    t = AdapterTable(2)
    assert t.plan("a") is None
    t.loaded("a", "/a", t.new_id())
    assert t.plan("b") is None and t.free_slots() == 1
    t.loaded("b", "/b", t.new_id())
    assert t.free_slots() == 0 and t.held() == ["b", "a"] and t.open_slots() == 2
    t.started("a", "r1")
    assert t.open_slots() == 1  # a's slot is busy: only b's could take a new adapter


def test_the_least_recently_used_idle_adapter_makes_room():
    t = AdapterTable(2)
    for name in ("a", "b"):
        t.loaded(name, f"/{name}", t.new_id())
    t.use("a")  # b is now the least recently used
    assert t.plan("c").name == "b"
    t.started("b", "r1")  # ... but a request runs with it: a goes instead
    assert t.plan("c").name == "a"
    assert t.plan("b") is None  # held: nothing to unload


def test_every_slot_busy_loads_beyond_the_slots_until_one_is_idle():
    t = AdapterTable(1)
    t.loaded("a", "/a", t.new_id())
    t.started("a", "r1")
    assert t.plan("b") is None  # a is in use: b loads beyond the slots (its request waits in the engine's queue)
    t.loaded("b", "/b", t.new_id())
    t.started("b", "r2")
    assert t.held() == ["b", "a"] and t.open_slots() == 0
    gone = t.ended("a", "r1")  # a is idle and the least recently used: it goes, one adapter per slot again
    assert [g.name for g in gone] == ["a"] and not gone[0].unloading
    t.unloaded("a", evicted=True)
    assert t.held() == ["b"] and t.evictions == 1 and t.ended("b", "r2") == []


def test_no_slots_means_no_adapters():
    with pytest.raises(EngineError, match=r"serves no LoRA adapters \(lora.slots = 0\)"):
        AdapterTable(0).plan("a")


def test_unload_waits_for_the_running_requests():
    t = AdapterTable(2)
    t.loaded("a", "/a", t.new_id())
    t.started("a", "r1")
    t.started("a", "r2")
    assert t.unload_when_idle("a") is False and t.unloading("a")
    assert t.ended("a", "r1") == []
    gone = t.ended("a", "r2")
    assert [g.name for g in gone] == ["a"] and gone[0].unloading
    t.unloaded("a")
    assert t.held() == [] and t.free_slots() == 2
    t.loaded("b", "/b", t.new_id())
    assert t.unload_when_idle("b") is True  # idle: at once


@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.sampled_from(["start", "load", "end"])), max_size=60))
def test_the_table_never_unloads_a_busy_adapter_and_holds_its_slots_once_idle(ops):
    t = AdapterTable(3)
    running: dict[str, set[str]] = {}
    for k, (name, op) in enumerate(ops):
        if op == "end":
            if running.get(name):
                gone = t.ended(name, running[name].pop())
                for g in gone:
                    assert not running.get(g.name)
                    t.unloaded(g.name, evicted=True)
            continue
        victim = t.plan(name)
        if victim is not None:
            assert not running.get(victim.name)
            t.unloaded(victim.name, evicted=True)
        if name not in t:
            t.loaded(name, f"/{name}", t.new_id())
        if op == "start":
            t.started(name, f"r{k}")
            running.setdefault(name, set()).add(f"r{k}")
        busy = sum(1 for a in t.held() if running.get(a))
        assert len(t.held()) <= max(3, busy + 1)  # beyond the slots only while their adapters are in use


# ------------------------------------------------------------------ checks before a load


def _adapter(tmp_path, name="a", rank=8, shapes=None):
    d = tmp_path / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"r": rank, "base_model_name_or_path": "/models/other"}))
    if shapes is not None:
        import torch
        from safetensors.torch import save_file

        save_file({k: torch.zeros(v) for k, v in shapes.items()}, str(d / "adapter_model.safetensors"))
    return d


def test_a_bad_path_names_the_adapter(tmp_path):
    with pytest.raises(EngineError, match=r"adapter 'x': '.*missing' is not a directory"):
        check_adapter_dir("x", str(tmp_path / "missing"), 16)
    (tmp_path / "empty").mkdir()
    with pytest.raises(EngineError, match="adapter 'x': .* holds no adapter_config.json"):
        check_adapter_dir("x", str(tmp_path / "empty"), 16)


def test_a_rank_over_the_limit_names_the_adapter_and_the_setting(tmp_path):
    d = _adapter(tmp_path, rank=64)
    with pytest.raises(EngineError, match="adapter 'a': its rank is 64, over this instance's limit lora.max_rank = 16"):
        check_adapter_dir("a", str(d), 16)
    assert check_adapter_dir("a", str(d), 64)["r"] == 64


def test_an_adapter_of_another_base_does_not_fit(tmp_path):
    hf = SimpleNamespace(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)
    dims = module_dims(hf)
    assert dims["q_proj"] == (256, 256) and dims["v_proj"] == (256, 128) and dims["down_proj"] == (512, 256)
    key = "base_model.model.model.layers.0.{}.lora_{}.weight"
    good = _adapter(tmp_path, "good", shapes={key.format("self_attn.v_proj", "A"): (8, 256),
                                              key.format("self_attn.v_proj", "B"): (128, 8)})
    check_shapes("good", str(good), dims)
    bad = _adapter(tmp_path, "bad", shapes={key.format("self_attn.q_proj", "A"): (8, 128),
                                            key.format("self_attn.q_proj", "B"): (128, 8)})
    with pytest.raises(EngineError, match=r"adapter 'bad' does not fit this model \(it was made for /m\): its q_proj "
                                          r"has 128 inputs, this model's 256"):
        check_shapes("bad", str(bad), dims, "/m")


# ------------------------------------------------------------------ residency in dispatch


def _s(iid, adapters=(), slots=0, waiting=0, running=0, batch=8, **kw):
    return InstanceState(iid, 1000, running=running, waiting=waiting, batch_size=batch, adapters=tuple(adapters),
                         adapter_slots=slots, **kw)


def test_the_base_model_goes_anywhere():
    ss = [_s("i0"), _s("i1", ["a"], 1)]
    assert adapter_pool(ss, "") is ss


def test_holders_first_and_instances_without_adapters_never():
    ss = [_s("i0"), _s("i1", ["a"], 1), _s("i2", ["b"], 1)]
    assert [s.instance_id for s in adapter_pool(ss, "a")] == ["i1"]
    assert [s.instance_id for s in adapter_pool(ss, "c")] == ["i1", "i2"]  # nobody holds it: who may load it
    assert adapter_pool([_s("i0")], "a") == []


def test_hot_holders_let_another_instance_with_an_open_slot_load_it():
    ss = [_s("i0", ["a"], 0, waiting=2), _s("i1", ["b", "c"], 0), _s("i2", ["b"], 1)]
    assert [s.instance_id for s in adapter_pool(ss, "a")] == ["i0", "i2"]
    full = [_s("i0", ["a"], 0, running=8), _s("i1", ["b"], 1)]  # a full batch is hot too
    assert [s.instance_id for s in adapter_pool(full, "a")] == ["i0", "i1"]
    busy = [full[0], _s("i1", ["b"], 0)]  # i1's slot holds an adapter in use: it could not load a now
    assert [s.instance_id for s in adapter_pool(busy, "a")] == ["i0"]


def test_when_every_instance_is_hot_the_holders_keep_it():
    ss = [_s("i0", ["a"], 0, waiting=2), _s("i1", ["b"], 1, waiting=1)]
    assert [s.instance_id for s in adapter_pool(ss, "a")] == ["i0"]  # a load there would only join a queue
    assert [s.instance_id for s in adapter_pool(ss, "c")] == ["i1"]  # nobody holds it: where it can load


def test_the_replica_bound_keeps_a_hot_adapter_where_it_is():
    ss = [_s("i0", ["a"], 1, waiting=3), _s("i1", ["a"], 1, waiting=1), _s("i2", [], 2)]  # i2: not hot
    assert [s.instance_id for s in adapter_pool(ss, "a", max_replicas=2)] == ["i0", "i1"]
    assert [s.instance_id for s in adapter_pool(ss, "a", max_replicas=3)] == ["i0", "i1", "i2"]


def test_place_prefers_a_holder_over_a_freer_instance():
    holder = _s("i0", ["a"], 1, running=3, blocks_used=600)
    free = _s("i1", [], 2)
    rules = policy.Rules()
    assert policy.place("llumnix", [holder, free], policy.Ask(10), 0, rules).instance_id == "i1"
    assert policy.place("llumnix", [holder, free], policy.Ask(10, adapter="a"), 0, rules).instance_id == "i0"
    hot = dataclasses.replace(holder, waiting=2)
    assert policy.place("llumnix", [hot, free], policy.Ask(10, adapter="a"), 0, rules).instance_id == "i1"
    bounded = dataclasses.replace(rules, max_replicas=1)
    assert policy.place("llumnix", [hot, free], policy.Ask(10, adapter="a"), 0, bounded).instance_id == "i0"


def test_state_of_reads_the_adapters_from_the_load():
    load = wire.InstanceLoad(100, 0, 0, 0, 8, 16, adapters=["a", "b"], adapter_slots=1)
    s = policy.state_of("i0", load)
    assert s.adapters == ("a", "b") and s.adapter_slots == 1


def test_an_adapters_blocks_are_keyed_apart_as_vllm_keys_them():
    tokens = list(range(64))
    base = prefix.block_hashes(tokens, 16)
    a = prefix.block_hashes(tokens, 16, extra_keys=prefix.adapter_keys("a", "/m/a"))
    b = prefix.block_hashes(tokens, 16, extra_keys=prefix.adapter_keys("b", "/m/b"))
    assert len({base[0], a[0], b[0]}) == 3
    assert prefix.adapter_keys("", "") is None  # the base model: vLLM hashes no extra keys
    assert prefix.adapter_keys("a", "/m/a") == (("lora", "a", "/m/a"),)  # vLLM's _gen_lora_extra_hash_keys


# ------------------------------------------------------------------ settings, the proxy's check, the catalogue


def test_lora_adapters_setting(tmp_path):
    assert parse_adapters(" sql=/m/sql, chat = /m/chat ,") == {"sql": "/m/sql", "chat": "/m/chat"}
    with pytest.raises(ConfigError, match="'sql' is not NAME=PATH"):
        parse_adapters("sql")
    with pytest.raises(ConfigError, match="adapter 'a' is named twice"):
        parse_adapters("a=/x,a=/y")
    with pytest.raises(ConfigError, match="lora.slots is 0"):
        load_config(None, ["lora.adapters=a=/x"])
    with pytest.raises(ConfigError, match="the base model's name"):
        load_config(None, ["lora.adapters=llumnix-sim=/x", "lora.slots=1"])
    cfg = load_config(None, ["lora.adapters=a=/x", "lora.slots=2", "lora.max_replicas=3"])
    assert policy.rules_of(cfg).max_replicas == 3


def test_the_proxy_serves_the_adapters_it_knows():
    from daemons.proxy.api.protocol import ApiError
    from daemons.proxy.front.checks import Checks

    known = {"sql": "/m/sql"}
    checks = Checks(None, "base", 4096, adapters=lambda: known)
    assert checks.check_model(None) == "" and checks.check_model("base") == ""
    assert checks.check_model("sql") == "sql"
    with pytest.raises(ApiError) as err:
        checks.check_model("chat")
    assert err.value.status == 404 and err.value.code == "model_not_found"
    assert err.value.body()["error"]["message"] == "The model `chat` does not exist. This proxy serves `base`, `sql`."


class _Cluster:
    def __init__(self, *records):
        self._r = {r.instance_id: r for r in records}

    def records(self):
        return list(self._r.values())

    def get(self, iid):
        return self._r.get(iid)


def _rec(iid, adapters=(), slots=0, state="alive"):
    return SimpleNamespace(instance_id=iid, state=state,
                           load=wire.InstanceLoad(100, 0, 0, 0, 8, 16, adapters=list(adapters), adapter_slots=slots))


def test_the_manager_orders_loads_and_keeps_the_catalogue():
    from daemons.manager.adapters import Adapters

    cfg = load_config(None, ["lora.adapters=sql=/m/sql", "lora.slots=2", "lora.max_replicas=1"])
    cluster = _Cluster(_rec("i0", ["sql"], 1), _rec("i1", [], 2), _rec("i2"))  # i2: LoRA off
    sent = []
    ids = iter(range(1, 100))
    adapters = Adapters(cfg, cluster, lambda r, m: sent.append((r.instance_id, m)), lambda: next(ids), timeout_s=1.0)

    async def run():
        listed = await adapters.on_query(wire.LoraQuery(1, "list"))
        assert [(r.name, r.path, r.instances) for r in listed.adapters] == [("sql", "/m/sql", ["i0"])]
        task = asyncio.ensure_future(adapters.on_query(wire.LoraQuery(2, "load", "chat", "/m/chat")))
        await asyncio.sleep(0)
        assert [(iid, m.op, m.name) for iid, m in sent] == [("i1", "load", "chat")]  # one replica: most free slots
        adapters.on_result(wire.LoraResult(sent[0][1].query_id, "i1", True, "loaded"))
        reply = await task
        assert reply.outcomes == [wire.AdapterOutcome("i1", True, "loaded")] and adapters.catalogue["chat"] == "/m/chat"
        sent.clear()
        task = asyncio.ensure_future(adapters.on_query(wire.LoraQuery(3, "load", "bad", "/m/bad", ["i0"])))
        await asyncio.sleep(0)
        adapters.on_result(wire.LoraResult(sent[0][1].query_id, "i0", False, "adapter 'bad': its rank is 64, ..."))
        refused = await task
        assert isinstance(refused, wire.ErrorReply) and "i0: adapter 'bad': its rank is 64" in refused.message
        assert "bad" not in adapters.catalogue
        assert isinstance(await adapters.on_query(wire.LoraQuery(4, "load", "x", "/m/x", ["i9"])), wire.ErrorReply)
        assert "base model" in (await adapters.on_query(wire.LoraQuery(5, "load", cfg.model.name, "/m"))).message
        missing = await adapters.on_query(wire.LoraQuery(6, "unload", "nope"))
        assert isinstance(missing, wire.ErrorReply) and "'nope' is not loaded" in missing.message
        late = await adapters.on_query(wire.LoraQuery(7, "load", "slow", "/m/slow", ["i1"]))  # nobody answers
        assert isinstance(late, wire.ErrorReply) and "no answer within 1s" in late.message

    asyncio.run(run())


# ------------------------------------------------------------------ the sim engine's adapters


def _sim(slots=2, adapters="a=/m/a", load_ms=50.0):
    from daemons.config import LoraConfig, ModelConfig, SimConfig
    from daemons.engine.sim import SimEngine

    sim = SimConfig(time_scale=1.0, eos_rate=0.0)
    return SimEngine(sim, ModelConfig(), kv=False, lora=LoraConfig(slots=slots, adapters=adapters, load_ms=load_ms))


def _req(rid, adapter="", path="", tokens=4):
    from daemons.engine.base import EngineRequest

    return EngineRequest(rid, [5] * 8, wire.SamplingParams(max_tokens=tokens, ignore_eos=True), adapter=adapter,
                         adapter_path=path)


def test_the_sim_engine_holds_adapters_in_slots_and_a_load_takes_its_time():
    e = _sim()
    assert (e.load().adapters, e.load().adapter_slots) == (["a"], 2)  # lora.adapters, loaded; a's slot idle: open
    e.add_request(_req("r1", "a"))
    plain = e.step().model_time_s  # held: no load time
    e.add_request(_req("r2", "b", "/m/b"))
    assert e.load().adapters == ["b", "a"] and e.load().adapter_slots == 0
    loading = e.step().model_time_s
    assert loading >= plain + 0.05 - 1e-9
    e.add_request(_req("r3", "c", "/m/c"))  # both slots' adapters in use: c loads beyond them
    assert e.load().adapters == ["c", "b", "a"] and e.load().adapter_slots == 0
    while e.has_work():
        e.step()
    # Idle again: the least recently used (a) goes, one adapter per slot.
    assert e.load().adapters == ["c", "b"] and e.adapters.table.evictions == 1 and e.adapters.table.loads == 3


def test_the_sim_engine_without_slots_refuses_an_adapter():
    e = _sim(slots=0, adapters="")
    assert e.adapters is None and e.load().adapters == [] and e.load().adapter_slots == 0
    with pytest.raises(EngineError, match=r"serves no LoRA adapters \(lora.slots = 0\)"):
        e.add_request(_req("r1", "a", "/m/a"))


def test_an_unload_waits_for_the_sim_requests_running_with_it():
    e = _sim()
    e.add_request(_req("r1", "a", tokens=3))
    e.step()
    assert e.adapters.unload("a") is True and e.load().adapters == ["a"]  # r1 still runs with it
    while e.has_work():
        e.step()
    assert e.adapters.unload("b") is False
    e.adapters.load("b", "/m/b")  # any call looks again: r1 has left, a goes
    assert e.load().adapters == ["b"]


def test_the_sim_prefix_cache_keeps_an_adapters_blocks_apart():
    from daemons.config import LoraConfig, ModelConfig, SimConfig
    from daemons.engine.base import EngineRequest
    from daemons.engine.sim import SimEngine

    e = SimEngine(SimConfig(prefix_caching=True, eos_rate=0.0), ModelConfig(), kv=False, lora=LoraConfig(slots=2))
    prompt = list(range(100, 164))  # 4 full blocks of 16

    def run(rid: str, adapter: str = "") -> int:
        before = e.cache.hit_tokens
        e.add_request(EngineRequest(rid, prompt, wire.SamplingParams(max_tokens=2, ignore_eos=True), adapter=adapter,
                                    adapter_path=f"/m/{adapter}" if adapter else ""))
        while e.has_work():
            e.step()
        return e.cache.hit_tokens - before

    assert run("base") == 0
    assert run("a1", "a") == 0  # the base model's blocks are not the adapter's
    again = run("a2", "a")  # the adapter's own are
    assert again > 0
    assert run("b1", "b") == 0  # nor another adapter's
    assert run("base2") == again


def test_the_manager_dispatches_a_lora_request_to_a_holder_and_snapshots_carry_the_catalogue():
    from tests.support.manager import Bench

    async def scenario(b: Bench):
        b.instance("i0", blocks_used=60, adapters=["a"], adapter_slots=1)  # busier, but it holds a
        b.instance("i1", adapter_slots=2)
        await b.heartbeats(1.5)

        def ask(adapter: str) -> list[str]:
            msgs = [wire.Dispatch(k, f"r{k}", 16, 0, adapter=adapter) for k in range(3)]
            return [r.instance_id for r in b.m.on_dispatch_batch(msgs)]

        assert ask("a") == ["i0", "i0", "i0"]
        assert ask("") == ["i1", "i1", "i1"]  # the base model: by load
        assert ask("b") == ["i1", "i1", "i1"]  # held nowhere: the freest that may load it
        assert b.m.snapshot(1).adapters == {"a": "/m/a"}
        assert [(r.name, r.instances) for r in b.m.adapters.rows()] == [("a", ["i0"])]

    Bench.run(scenario, ["lora.slots=2", "lora.adapters=a=/m/a"])

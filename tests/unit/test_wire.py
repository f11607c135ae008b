import msgspec
import pytest
from hypothesis import given, strategies as st

from daemons import wire


def _samples():
    load = wire.InstanceLoad(blocks_total=100, blocks_used=10, running=2, waiting=1, batch_size=8, block_size=16)
    view = wire.InstanceView("i0", "h", 1, "alive", "tcp://a:1", "sim", "m", load, 1.5, 0.1)
    return [
        wire.Register("i0", "h", 1, "tcp://a:1", "sim", "m", load),
        wire.Register("i0", "h", 1, "tcp://a:1", "sim", "m", load, kv_spec="engine=sim;layout=block-major;tp=2"),
        wire.RegisterAck("i0", accepted=False, reason="x"),
        wire.LoadReport("i0", 3, load),
        wire.Goodbye("i0"),
        wire.Dispatch(1, "r", 5, 1, ["i1"]),
        wire.DispatchReply(1, "i0", "tcp://a:1"),
        wire.DispatchReply(1, "i0", "tcp://a:1", disagg="remote"),
        wire.SnapshotQuery(2),
        wire.SnapshotQuery(3, "tcp://127.0.0.1:5555"),
        wire.Dispatched("r", "i0", 5, 1),
        wire.Snapshot(2, [view]),
        wire.StatusQuery(3),
        wire.RequestsQuery(4),
        wire.RequestsReply(4, [wire.RequestInfo("r", "i0", "running", 3, 5, 1)]),
        wire.SessionsQuery(4, limit=10),
        wire.SessionsReply(4, [wire.SessionRow("chat-1", "i0", 3, 900, 56, 12.5, 0.5, {"i0": 40}, {"i0": 16, "i1": 56})],
                           known=7),
        wire.Dispatched("r", "i0", 900, 0, "chat-1", [1, 2, 3]),
        wire.DispatchReply(4, "i1", "tcp://a:1", pull_from="i0", pull_blocks=12, how="pull"),
        wire.ErrorReply(5, "no"),
        wire.ListRequests(6),
        wire.RequestList(6, "i0", [wire.RequestLoad("r", "running", 1, 5, 3)]),
        wire.Submit("r", [1, 2, 3], wire.SamplingParams(max_tokens=4, seed=7, stop_token_ids=[9]), "tcp://p:3"),
        wire.Abort("r"),
        wire.TokenBatch("i0", [wire.TokenOut("r", 0, 5), wire.TokenOut("r", 1, 2, "stop", -0.5)]),
        wire.RequestFailed("r", "i0", "boom", True, 400),
        wire.Moved("r", "i1", "tcp://b:2"),
        wire.MigrateQuery(7, "i1", request_id="r"),
        wire.MigrateReply(7, [wire.MigrationOutcome("r", "i0", "i1", "committed", stages=2, blocks=3, bytes=99,
                                                     downtime_ms=1.5, total_ms=9.0, resumed_at=4)]),
        wire.MigrateStart(8, "i1", "tcp://b:2", ["r"], blocking=True),
        wire.MigrateResult(8, "i0", [wire.MigrationOutcome("r", "i0", "i1", "aborted", "no room")]),
        wire.MigStage("m", 0, 40, 0, 2, request=wire.MigratingRequest("r", [1, 2], wire.SamplingParams(), "tcp://p:3"),
                      kv_spec="sim", src="i0", kv_address="127.0.0.1:5", pair_key="i0>i1/1", chunk_blocks=8),
        wire.MigStage("m", 1, 80, 2, 3, last=True, state=wire.RequestState([5, 6], 2, b"\x00\x01")),
        wire.MigReady("m", 0, False, "no room"),
        wire.MigDone("m", 1),
        wire.MigAbort("m", "finished"),
        wire.PrefixQuery(1, [[1, 2, 3], []]),
        wire.PrefixHits(1, [2, 0]),
        wire.KvRendezvous("i0>i1/ab", "i0>i1/ab/0/0", b"addr"),
        wire.PullAsk(1, "i1", [b"h" * 32], "spec"),
        wire.PullOffer(1, 2, 4096, "i0>i1#pull/ab", ""),
        wire.Rehome("i1", "tcp://127.0.0.1:5000", 2),
        wire.RehomePull("i0", "tcp://127.0.0.1:5001", "chat-1", [b"h" * 32], 30.0),
        wire.CacheEvents("i0", 7, 3, stored=[1, 2**64 - 1], removed=[5]),
        wire.CacheSync("tcp://p:1"),
        wire.MigrateStart(9, "i1", "tcp://b:2", count=2, reason="drain", selection="llumnix", drain=True,
                          src_usage=float("inf"), dst_usage=10.5, dst_blocks=100, headroom=0.1, cooldown_s=10),
        wire.SetDraining(True, "operator", cordoned=True),
        wire.Shutdown("remove"),
        wire.Redispatch("r", "i0", "draining"),
        wire.Heartbeat("i0", "tcp://a:1", False, wire.InstanceLoad(8, 1, 1, 0, 4, 16, stalled=True)),
        wire.ProxyAlive("tcp://p:3"),
        wire.Submit("r", [1, 2], wire.SamplingParams(), "tcp://p:3", epoch=3, output_token_ids=[7, 8]),
        wire.Abort("r", 2),
        wire.Moved("r", "i1", "tcp://b:2", 2, 5),
        wire.DrainQuery(10, "i0", drain=False, cordon_only=True),
        wire.DrainReply(10, wire.InstanceView("i0", "h", 1, "alive", "tcp://a:1", "sim", "m", load, float("-inf"), 0.1,
                                              draining=True, virtual_usage=float("inf"), drain_reason="operator")),
        wire.RemoveQuery(11, "i0", 30.0),
        wire.RemoveReply(11, "i0", 1.5, 3),
        wire.AddQuery(12, 2),
        wire.AddReply(12, ["i2", "i3"]),
        wire.PolicyQuery(13, dispatch_policy="rr"),
        wire.PolicyReply(13, "rr", "llumnix", "llumnix", "off", False),
        wire.SetRole("prefill", "operator"),
        wire.HandoverReady("i0", "r1", 900, 57, 1, 40.0),
        wire.PeerDead("i1", "tcp://127.0.0.1:5001"),
        wire.PeerLink("i1", "tcp://127.0.0.1:5001"),
        wire.LinkOpen("i0>i1/ab12", "i0", "engine=sim;tp=1", "", 2048),
        wire.LinkReady("i0>i1/ab12", False, "KV layout differs: tensor-parallel size differs: source 2, destination 1"),
        wire.RoleQuery(14, "i0", "decode"),
        wire.RoleReply(14, "i0", "decode", "prefill", 2),
        wire.LoraQuery(15, "load", "sql", "/models/sql", ["i0"]),
        wire.LoraReply(15, [wire.AdapterRow("sql", "/models/sql", ["i0"])], [wire.AdapterOutcome("i0", True, "loaded")]),
        wire.LoraOrder(16, "load", "sql", "/models/sql"),
        wire.LoraResult(16, "i0", False, "adapter 'sql': its rank is 64, over this instance's limit lora.max_rank = 16"),
        wire.Submit("r", [1, 2], wire.SamplingParams(), "tcp://p:1", adapter="sql", adapter_path="/models/sql"),
        wire.LoadReport("i0", 4, wire.InstanceLoad(100, 10, 2, 1, 8, 16, adapters=["sql", "chat"], adapter_slots=2)),
    ]


@pytest.mark.parametrize("msg", _samples(), ids=lambda m: type(m).__name__)
def test_roundtrip(msg):
    assert wire.decode(wire.encode(msg)) == msg


def test_every_message_kind_has_a_distinct_tag():
    tags = [t.__struct_config__.tag for t in wire.Message.__args__]
    assert len(tags) == len(set(tags))
    assert {type(m) for m in _samples()} == set(wire.Message.__args__)


@given(st.binary(max_size=200))
def test_random_bytes_never_raise(frame):
    msg = wire.decode(frame)
    assert msg is None or isinstance(msg, wire.Message.__args__)


def test_wrong_shape_is_dropped():
    assert wire.decode(msgspec.msgpack.encode([40, "r"])) is None  # a Submit missing fields
    assert wire.decode(msgspec.msgpack.encode([999, "x"])) is None  # unknown kind
    assert wire.decode(msgspec.msgpack.encode({"k": 41})) is None


def test_older_peer_reads_newer_message_with_extra_trailing_field():
    newer = msgspec.msgpack.encode([41, "r", 3, "some future field"])
    assert wire.decode(newer) == wire.Abort("r", 3)


def test_cache_events_are_bounded_and_a_cache_sync_names_an_address():
    over = msgspec.msgpack.encode([55, "i0", 1, 1, list(range(wire.MAX_CACHE_KEYS + 1))])
    assert wire.decode(over) is None
    assert wire.decode(msgspec.msgpack.encode([43, "not an address"])) is None
    assert wire.decode(wire.encode(wire.CacheSync())) == wire.CacheSync()


def test_lora_fields_are_appended_and_an_older_peer_still_decodes():
    """The adapter fields go at the end with defaults: a Submit or a load without them encodes as before, and one
    with them decodes with the older struct's fields intact (array_like: an older peer reads the prefix)."""
    plain = wire.Submit("r", [1, 2], wire.SamplingParams(), "tcp://p:1", epoch=3)
    assert wire.decode(wire.encode(plain)) == plain
    with_adapter = msgspec.structs.replace(plain, adapter="sql", adapter_path="/m/sql")
    assert len(msgspec.msgpack.encode(with_adapter)) > len(msgspec.msgpack.encode(plain))
    back = wire.decode(wire.encode(with_adapter))
    assert (back.adapter, back.adapter_path, back.epoch) == ("sql", "/m/sql", 3)
    load = wire.InstanceLoad(100, 10, 2, 1, 8, 16)
    assert msgspec.msgpack.encode(load) == msgspec.msgpack.encode(msgspec.structs.replace(load, adapters=[], adapter_slots=0))

import msgspec
import pytest
from hypothesis import given, strategies as st

from daemons import wire


def _samples():
    load = wire.InstanceLoad(blocks_total=100, blocks_used=10, running=2, waiting=1, batch_size=8, block_size=16)
    view = wire.InstanceView("i0", "h", 1, "alive", "tcp://a", "sim", "m", load, 1.5, 0.1)
    return [
        wire.Register("i0", "h", 1, "tcp://a", "sim", "m", load),
        wire.RegisterAck("i0", accepted=False, reason="x"),
        wire.LoadReport("i0", 3, load),
        wire.Goodbye("i0"),
        wire.Dispatch(1, "r", 5, 1, ["i1"]),
        wire.DispatchReply(1, "i0", "tcp://a"),
        wire.SnapshotQuery(2),
        wire.Snapshot(2, [view]),
        wire.StatusQuery(3),
        wire.RequestsQuery(4),
        wire.RequestsReply(4, [wire.RequestInfo("r", "i0", "running", 3, 5, 1)]),
        wire.ErrorReply(5, "no"),
        wire.ListRequests(6),
        wire.RequestList(6, "i0", [wire.RequestLoad("r", "running", 1, 5, 3)]),
        wire.Submit("r", [1, 2, 3], wire.SamplingParams(max_tokens=4, seed=7, stop_token_ids=[9]), "tcp://p"),
        wire.Abort("r"),
        wire.TokenBatch("i0", [wire.TokenOut("r", 0, 5), wire.TokenOut("r", 1, 2, "stop", -0.5)]),
        wire.RequestFailed("r", "i0", "boom", True, 400),
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
    newer = msgspec.msgpack.encode([41, "r", "some future field"])
    assert wire.decode(newer) == wire.Abort("r")

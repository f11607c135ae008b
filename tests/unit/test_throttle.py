"""daemons/throttle.py: once per interval per key, and a bounded memory of keys."""

from daemons.throttle import Throttle


def test_once_per_interval_per_key():
    t = Throttle(60.0)
    assert t.due("a", 0.0) and not t.due("a", 59.0) and t.due("b", 59.0) and t.due("a", 60.0)


def test_made_up_keys_do_not_grow_it_and_the_oldest_is_forgotten_first():
    t = Throttle(60.0, cap=100)
    for i in range(100_000):
        assert t.due(f"random-key-{i}", 1.0)
    assert len(t) == 100
    assert t.due("random-key-0", 2.0)  # forgotten: said again
    assert not t.due("random-key-99999", 2.0)  # the newest is remembered

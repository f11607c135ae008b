"""``metrics.off()``: within it no metric counts (a simulation's many daemon parts in one process); after it,
they count again."""

from prometheus_client import REGISTRY

from daemons import metrics

G = metrics.gauge("manager", "llumnix_test_off_gauge", "a gauge for this test")
C = metrics.counter("manager", "llumnix_test_off_total", "a counter for this test", ["why"])


def _value(name, **labels):
    return REGISTRY.get_sample_value(name, {"model_name": metrics.bound()["model_name"], **labels})


def test_off_counts_nothing_and_nests():
    G.set(3)
    C.labels("a").inc()
    assert metrics.counting()
    with metrics.off():
        with metrics.off():
            G.set(7)
        assert not metrics.counting()
        C.labels("a").inc(5)
        G.labels().set(9)
    assert metrics.counting()
    assert _value("llumnix_test_off_gauge") == 3 and _value("llumnix_test_off_total", why="a") == 1
    G.set(4)
    assert _value("llumnix_test_off_gauge") == 4

"""The sim engine's priorities: queue order, head-of-line blocking and preemption by priority."""

from __future__ import annotations

from tests.unit.test_sim_engine import Runner, engine, req, states


def admission_order(run: Runner) -> list[str]:
    """Step until idle; the order in which requests not running now start (or restart) running."""
    order = []
    while run.e.has_work():
        before = states(run.e)
        run.step()
        order += [rid for rid, s in states(run.e).items() if s == "running" and before[rid] != "running"]
    return order


def test_high_priority_is_admitted_before_queued_normal_ones():
    e = engine(max_num_seqs=1)
    run = Runner(e)
    for rid in ["n0", "n1", "n2"]:
        e.add_request(req(rid, 2, max_tokens=3))
    run.step()  # n0 runs; n1, n2 queue
    e.add_request(req("h0", 2, max_tokens=3, priority=1))
    e.add_request(req("h1", 2, max_tokens=3, priority=1))
    e.add_request(req("n3", 2, max_tokens=3))
    assert [(r.request_id, r.state, r.priority) for r in e.requests()] == [
        ("n0", "running", 0), ("h0", "waiting", 1), ("h1", "waiting", 1), ("n1", "waiting", 0),
        ("n2", "waiting", 0), ("n3", "waiting", 0)]
    assert e.load().high_priority == 0  # waiting high-priority requests do not count
    assert e.load().hol_demand_blocks == 1
    assert admission_order(run) == ["h0", "h1", "n1", "n2", "n3"]  # FCFS within a priority


def test_high_priority_head_of_line_blocks_normal_ones():
    e = engine(block_size=4, num_blocks=8)
    run = Runner(e)
    e.add_request(req("R", 16, max_tokens=3))  # 5 blocks
    run.step()
    e.add_request(req("SMALL", 2, max_tokens=3))  # 1 block: would fit
    e.add_request(req("BIG", 12, max_tokens=3, priority=1))  # 4 blocks, 3 free: heads the queue
    run.step()
    assert states(e) == {"R": "running", "BIG": "waiting", "SMALL": "waiting"}
    assert e.load().hol_demand_blocks == 4
    run.step()  # R finishes
    run.step()
    assert states(e) == {"BIG": "running", "SMALL": "running"}
    assert e.load().high_priority == 1
    run.drain()


def test_normal_requests_are_preempted_before_high_priority_ones():
    # 8 blocks of 2 tokens. N0, N1 (4-token prompts, 3 blocks each) run first; H0, H1 (1-token prompts)
    # are admitted a step later, so by admission order alone they would be the first victims.
    e = engine(block_size=2, num_blocks=8, max_num_seqs=4)
    run = Runner(e)
    e.add_request(req("N0", 4, max_tokens=10))
    e.add_request(req("N1", 4, max_tokens=10))
    run.step()
    e.add_request(req("H0", 1, max_tokens=12, priority=1))
    e.add_request(req("H1", 1, max_tokens=12, priority=1))
    run.step()
    assert e.load().blocks_used == 8 and e.load().high_priority == 2
    e.add_request(req("W", 1, max_tokens=2))  # queued normal: a preempted normal request goes ahead of it
    e.add_request(req("HW", 1, max_tokens=2, priority=1))
    run.step()  # H0 needs a block, none free: N1, the newest normal request, goes
    assert [(r.request_id, r.state) for r in e.requests()] == [
        ("N0", "running"), ("H0", "running"), ("H1", "running"),
        ("HW", "waiting"), ("N1", "preempted"), ("W", "waiting")]
    assert e.load().preemptions == 1 and e.load().high_priority == 2
    victims: list[tuple[str, int]] = []  # (request, normal requests running right after it was preempted)
    while e.has_work():
        before = states(e)
        run.step()
        after = states(e)
        normal_running = sum(s == "running" and not rid.startswith("H") for rid, s in after.items())
        victims += [(rid, normal_running) for rid, s in after.items() if s == "preempted" and before[rid] == "running"]
    assert any(rid.startswith("H") for rid, _ in victims), "the test should end up preempting a high one"
    assert all(n == 0 for rid, n in victims if rid.startswith("H"))  # only once no normal one was left
    assert {rid: len(out) for rid, out in run.out.items()} == {"N0": 10, "N1": 10, "H0": 12, "H1": 12, "W": 2, "HW": 2}


def test_a_step_that_preempts_admits_nothing():
    e = engine(block_size=2, num_blocks=8)
    run = Runner(e)
    e.add_request(req("N0", 7, max_tokens=4))  # 4 blocks each: all 8 used
    e.add_request(req("N1", 7, max_tokens=4))
    run.step()
    e.add_request(req("H", 1, max_tokens=2, priority=1))  # heads the queue, needs 1 block
    run.step()  # N0 needs a block: N1 goes, and H would fit in what it freed, but the step was short of blocks
    assert states(e) == {"N0": "running", "H": "waiting", "N1": "preempted"}
    run.step()
    assert states(e) == {"N0": "running", "H": "running", "N1": "preempted"}
    run.drain()


def test_preempted_request_goes_to_the_front_of_its_priority():
    e = engine(block_size=2, num_blocks=8, max_num_seqs=8)
    run = Runner(e)
    for rid in "ABCD":
        e.add_request(req(rid, 3, max_tokens=12, priority=1))  # 2 blocks each at admission: all 8 used
    e.add_request(req("n", 1, max_tokens=2))
    run.step()
    e.add_request(req("h", 1, max_tokens=2, priority=1))
    run.step()  # every request needs a third block: C and D go back, ahead of h but not of each other
    assert [(r.request_id, r.state) for r in e.requests()] == [
        ("A", "running"), ("B", "running"), ("C", "preempted"), ("D", "preempted"), ("h", "waiting"),
        ("n", "waiting")]
    assert e.load().high_priority == 2
    while not any(s == "running" for rid, s in states(e).items() if rid in "CDhn"):
        run.step()
    assert states(e)["C"] == "running" and states(e)["n"] == "waiting"
    run.drain()
    assert [o.index for o in run.out["C"]] == list(range(12))

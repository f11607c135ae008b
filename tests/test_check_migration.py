"""``llumnixctl check migration`` on the sim backend, and the comparison it rests on.

The vllm backend is left to operators and GPU nodes (scripts/gpu-check.sh): it takes minutes on CPU.
"""

from __future__ import annotations

import json

import pytest

from llumnixctl.experiments.check import Sample, first_mismatch
from tests.conftest import cli

pytestmark = pytest.mark.timeout(180)


@pytest.mark.e2e
def test_sim_requests_migrate_and_stream_what_unmigrated_runs_do():
    res = cli("check", "migration", "--backend", "sim", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["identical"] is True and out["backend"] == "sim"
    assert [r["kind"] for r in out["requests"]] == ["greedy", "greedy", "seeded", "seeded"]
    assert len({r["seed"] for r in out["requests"][2:]}) == 2
    for r in out["requests"]:
        assert r["migrations"] >= 1 and r["identical"] and r["first_mismatch"] is None, r
        assert r["tokens"] == 48 and r["downtime_ms"] > 0


def _sample(n: int = 10) -> Sample:
    return Sample(list(range(100, 100 + n)), [-0.5 - i / 10 for i in range(n)],
                  [{f"token_id:{100 + i}": -0.5 - i / 10, f"token_id:{7 + i}": -2.0} for i in range(n)])


def test_comparison_reports_the_first_differing_index():
    ref = _sample()
    assert first_mismatch(ref, _sample(), 0.0) is None
    got = _sample()
    got.ids[6] = 1
    got.ids[8] = 1
    assert first_mismatch(ref, got, 1e-4)[0] == 6
    got = _sample()
    got.logprobs[3] += 2e-4
    assert first_mismatch(ref, got, 1e-4)[0] == 3
    got.logprobs[3] = ref.logprobs[3] + 5e-5  # within the tolerance, not exact
    assert first_mismatch(ref, got, 1e-4) is None and first_mismatch(ref, got, 0.0)[0] == 3
    got = _sample()
    got.top[4] = {"token_id:104": -0.9, "token_id:5": -2.0}  # another alternative
    assert first_mismatch(ref, got, 1e-4)[0] == 4
    got = _sample()
    got.top[2]["token_id:9"] = -2.5
    assert first_mismatch(ref, got, 1e-4)[0] == 2
    assert first_mismatch(ref, _sample(7), 1e-4)[0] == 7  # stopped early
    assert first_mismatch(_sample(7), ref, 1e-4)[0] == 7  # went on too long


@pytest.mark.parametrize("args, message", [
    (["--backend", "nope"], "llumnixctl: unknown --backend 'nope'"),
    (["--backend", "sim", "--tp", "2"], "llumnixctl: --model and --tp are for --backend vllm"),
    (["--backend", "sim", "--set", "vllm.nope=1"], "llumnixctl: "),
])
def test_bad_arguments_exit_2_with_one_line(args, message):
    res = cli("check", "migration", *args)
    assert res.returncode == 2 and res.stderr.startswith(message) and res.stderr.count("\n") == 1, res.stderr

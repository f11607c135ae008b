"""The comparison ``llumnixctl check migration`` rests on, and its argument checks (the sim run itself:
tests/e2e/test_check_migration_sim.py).

The vllm backend is left to operators and GPU nodes (scripts/gpu-check.sh): it takes minutes on CPU.
"""

from __future__ import annotations


import pytest

from llumnixctl.experiments.bench.check import Sample, first_mismatch
from tests.conftest import cli

pytestmark = pytest.mark.timeout(180)


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

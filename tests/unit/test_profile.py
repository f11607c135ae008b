"""Latency profiles: interpolation, loading errors, the sim engine stepping by a profile, and measuring one."""

from __future__ import annotations

import json

import pytest

from daemons.config import ModelConfig, SimConfig
from daemons.engine.base import EngineError, EngineRequest
from daemons.engine.profile import LatencyProfile, ProfileError
from daemons.engine.sim import SimEngine
from daemons.wire import SamplingParams
from llumnixctl.experiments.sim.profile import measure

PROFILE = LatencyProfile([16, 256], [10.0, 70.0], [1, 8], [128, 512], [[4.0, 6.0], [12.0, 16.0]],
                         kv_bytes_per_token=1024, block_size=16)


def test_interpolation_is_exact_at_the_points_and_linear_between():
    assert PROFILE.prefill(16) == 10.0 and PROFILE.prefill(256) == 70.0
    assert PROFILE.prefill(136) == pytest.approx(40.0)
    assert PROFILE.prefill(496) == pytest.approx(130.0)  # extrapolated from the last two points
    assert PROFILE.decode(1, 128) == 4.0 and PROFILE.decode(8, 8 * 512) == 16.0
    assert PROFILE.decode(1, 320) == pytest.approx(5.0)
    assert PROFILE.decode(8, 8 * 320) == pytest.approx(14.0)
    assert PROFILE.step_ms(16, 8, 8 * 128) == pytest.approx(22.0)  # prefill and decode parts add up
    assert PROFILE.step_ms(0, 0, 0) == 0.0


def test_a_bad_profile_names_the_file_and_the_field(tmp_path):
    path = tmp_path / "p.json"
    data = PROFILE.to_json()
    data["decode"]["batch"] = [8, 1]
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=r"p\.json: decode\.batch must be .* increasing"):
        LatencyProfile.load(path)
    path.write_text("{")
    with pytest.raises(ProfileError, match="not JSON"):
        LatencyProfile.load(path)
    with pytest.raises(EngineError, match="sim.profile: .*cannot read"):
        SimEngine(SimConfig(profile=str(tmp_path / "none.json")), ModelConfig())


def test_the_sim_engine_steps_by_the_profile(tmp_path):
    path = tmp_path / "p.json"
    PROFILE.save(path)
    assert LatencyProfile.load(path) == PROFILE
    eng = SimEngine(SimConfig(profile=str(path), time_scale=2.0, kv_layers=1), ModelConfig())
    eng.add_request(EngineRequest("a", [1] * 100, SamplingParams(max_tokens=5, ignore_eos=True)))
    first = eng.step()  # prefill of 100 tokens
    assert first.model_time_s == pytest.approx(2.0 * PROFILE.prefill(100) / 1000)
    second = eng.step()  # one decode of a 101-token context
    assert second.model_time_s == pytest.approx(2.0 * PROFILE.decode(1, 101) / 1000)


def test_measuring_the_sim_recovers_its_latency_model():
    sim = SimConfig(kv_layers=1)
    prof = measure(SimEngine(sim, ModelConfig()), [16, 256], [1, 4], [128, 512], repeat=2)
    for n, ms in zip(prof.prefill_tokens, prof.prefill_ms):
        assert ms == pytest.approx(sim.prefill_ms_per_token * n + sim.prefill_ms)
    for b, row in zip(prof.decode_batch, prof.decode_ms):
        for c, ms in zip(prof.decode_context, row):
            # measured after prefill: each of the b requests holds its prompt plus the first token(s)
            expect = sim.decode_ms_per_seq * b + sim.decode_ms
            assert expect + sim.decode_ms_per_token * b * c <= ms <= expect + sim.decode_ms_per_token * b * (c + 4)
    assert prof.kv_bytes_per_token == 2 * sim.kv_heads * sim.head_dim * 2  # 1 layer, K and V, float16

"""Latency profiles: interpolation, loading errors, the sim engine stepping by a profile, and measuring one; the
profile's adapter load (its lora part): kept, the sim engine's loads taking it unless lora.load_ms is set, measured."""

from __future__ import annotations

import json

import pytest

from daemons.config import LoraConfig, ModelConfig, SimConfig
from daemons.engine.base import EngineError, EngineRequest
from daemons.engine.profile import LatencyProfile, LoraProfile, ProfileError
from daemons.engine.sim import SimEngine
from daemons.engine.sim_lora import DEFAULT_LOAD_MS
from daemons.wire import SamplingParams
from llumnixctl.experiments.sim.profile import measure
from llumnixctl.experiments.sim.profile_lora import adapter_rank, measure_lora

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


# ------------------------------------------------------------------ an adapter load's cost (the profile's lora part)

LORA = LoraProfile(rank=8, loads=5, load_ms=9.0, activate_ms=3.0, unload_ms=0.5)


def test_a_profile_keeps_its_adapter_load_and_one_written_before_it_has_none(tmp_path):
    path = tmp_path / "p.json"
    with_lora = LatencyProfile(**{**PROFILE.__dict__, "lora": LORA})
    with_lora.save(path)
    assert LatencyProfile.load(path) == with_lora and with_lora.lora.stall_ms == 12.0
    PROFILE.save(path)
    assert "lora" not in json.loads(path.read_text()) and LatencyProfile.load(path).lora is None
    data = with_lora.to_json()
    del data["lora"]["load_ms"]
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=r"p\.json: lora must be .*load_ms"):
        LatencyProfile.load(path)


def _lora_sim(tmp_path, load_ms: float, profile: LatencyProfile | None) -> SimEngine:
    sim = SimConfig(kv_layers=1)
    if profile is not None:
        profile.save(tmp_path / "p.json")
        sim = SimConfig(kv_layers=1, profile=str(tmp_path / "p.json"))
    return SimEngine(sim, ModelConfig(), kv=False, lora=LoraConfig(slots=2, load_ms=load_ms))


@pytest.mark.parametrize("load_ms, lora, stall", [(-1.0, LORA, 12.0), (-1.0, None, DEFAULT_LOAD_MS),
                                                  (30.0, LORA, 30.0), (0.0, LORA, 0.0)])
def test_the_sim_engine_loads_in_the_profiles_measured_time_unless_lora_load_ms_is_set(tmp_path, load_ms, lora, stall):
    eng = _lora_sim(tmp_path, load_ms, LatencyProfile(**{**PROFILE.__dict__, "lora": lora}))
    assert eng.adapters.load_s == pytest.approx(stall / 1000)
    eng.add_request(EngineRequest("a", [5] * 16, SamplingParams(max_tokens=1, ignore_eos=True), adapter="x",
                                  adapter_path="/m/x"))
    assert eng.step().model_time_s == pytest.approx((PROFILE.prefill(16) + stall) / 1000)


def test_without_a_profile_the_sim_engine_loads_in_50_ms_unless_lora_load_ms_is_set(tmp_path):
    assert LoraConfig().load_ms == -1.0
    assert _lora_sim(tmp_path, -1.0, None).adapters.load_s == pytest.approx(DEFAULT_LOAD_MS / 1000) == 0.05
    assert _lora_sim(tmp_path, 7.0, None).adapters.load_s == pytest.approx(0.007)


@pytest.mark.parametrize("load_ms", [40.0, 0.0])
def test_measuring_the_sims_adapter_loads_recovers_its_load_time(tmp_path, load_ms):
    eng = _lora_sim(tmp_path, load_ms, None)
    lines = []
    lora = measure_lora(eng, "/m/adapter", loads=3, log=lines.append)
    # The sim's load call costs no model time: its next step carries it, as the first step's extra time.
    assert lora.loads == 3 and lora.rank == 0 and len(lines) == 3
    assert lora.load_ms < 5.0 and lora.activate_ms == pytest.approx(load_ms)
    assert lora.stall_ms == pytest.approx(load_ms, abs=5.0)
    assert eng.adapters.table.held() == []  # the unloads measured at the end


def test_an_adapters_rank_is_read_from_its_config(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    assert adapter_rank(tmp_path) == 8 and adapter_rank(tmp_path / "none") == 0

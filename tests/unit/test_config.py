import dataclasses
import re
from pathlib import Path

import pytest

from daemons.config import Config, ConfigError, load_config, sections
from daemons.config_text import render_example

ROOT = Path(__file__).resolve().parents[2]


def test_example_file_matches_declaration():
    assert (ROOT / "llumnix.toml.example").read_text() == render_example(), \
        "llumnix.toml.example is stale: regenerate it with `llumnixctl config example > llumnix.toml.example`"


def test_example_file_loads_to_defaults():
    cfg = load_config(ROOT / "llumnix.toml.example")
    for name, _ in sections():
        assert getattr(cfg, name) == getattr(Config(), name)


def test_every_setting_has_help():
    for _, cls in sections():
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"


def test_file_then_overrides_then_flags(tmp_path):
    p = tmp_path / "l.toml"
    p.write_text('[manager]\nheartbeat_interval_s = 2\ndispatch_policy = "rr"\n[sim]\nnum_blocks = 10\n')
    cfg = load_config(p, ["sim.num_blocks=20"], {"manager.dispatch_policy": "flood", "proxy.port": None})
    assert cfg.manager.heartbeat_interval_s == 2.0 and isinstance(cfg.manager.heartbeat_interval_s, float)
    assert cfg.sim.num_blocks == 20
    assert cfg.manager.dispatch_policy == "flood"
    assert cfg.proxy.port == 8000


def test_env_names_the_file(tmp_path, monkeypatch):
    p = tmp_path / "env.toml"
    p.write_text("[proxy]\nport = 9999\n")
    monkeypatch.setenv("LLUMNIX_CONFIG", str(p))
    assert load_config().proxy.port == 9999


@pytest.mark.parametrize("text, words", [
    ("[manager]\nadress = 'x'\n", ["unknown key manager.adress"]),
    ("[managr]\naddress = 'x'\n", ["unknown section [managr]"]),
    ("[sim]\nnum_blocks = 'many'\n", ["sim.num_blocks must be int", "'many'"]),
    ("[sim]\nnum_blocks = true\n", ["sim.num_blocks must be int"]),
    ("[sim]\nnum_blocks = 0\n", ["sim.num_blocks must be >= 1"]),
    ("[manager]\ndispatch_policy = 'best'\n", ["manager.dispatch_policy must be one of"]),
    ("[manager\n", ["not valid TOML"]),
    ("manager = 3\n", ["manager must be a [section] table"]),
])
def test_bad_file_names_key_and_file(tmp_path, text, words):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    assert str(p) in str(exc.value)
    for w in words:
        assert w in str(exc.value)


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("/nonexistent/llumnix.toml")


def test_bad_override():
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(None, ["heartbeat=3"])
    with pytest.raises(ConfigError, match=r"--set sim.eos_rate=-1: sim.eos_rate must be >= 0"):
        load_config(None, ["sim.eos_rate=-1"])


@pytest.mark.parametrize("sets, message", [
    (["scaling.min_instances=3", "scaling.max_instances=2"], "scaling.min_instances (3) is above scaling.max_instances (2)"),
    (["scaling.scale_up_threshold=50", "scaling.scale_down_threshold=10"], "scaling.scale_up_threshold (50) must be below"),
])
def test_settings_that_must_agree(sets, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, sets)


def test_the_body_limit_follows_the_context_unless_set():
    from daemons.config import body_limit

    assert body_limit(load_config(None, [])) == (1 << 20) + 32 * 4096
    assert body_limit(load_config(None, ["model.max_model_len=131072"])) == (1 << 20) + 32 * 131072
    assert body_limit(load_config(None, ["proxy.max_body_bytes=8388608"])) == 8388608
    with pytest.raises(ConfigError, match="proxy.max_body_bytes must be 0 .* or >= 1024; got 5"):
        load_config(None, ["proxy.max_body_bytes=5"])

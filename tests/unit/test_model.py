"""The tiny-model writer: byte-identical for a seed, a LLaMA config that matches its weights, a tokenizer
that round-trips text and renders chats. Needs tokenizers and safetensors, never vllm."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from llumnixctl.lab.model import BOS, EOS, PAD, SIZES, app, kv_bytes_per_token, write_tiny_model  # noqa: E402

FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
TEXTS = [
    "The quick brown fox jumps over 13 lazy dogs.",
    "  leading spaces, tabs\tand\nnew lines  ",
    "Ünïcødé, emoji 🙂 and 日本語 survive byte-level BPE.",
]


def digests(path) -> dict[str, str]:
    return {f: hashlib.sha256((path / f).read_bytes()).hexdigest() for f in FILES}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def test_same_seed_same_bytes_other_seed_other_weights(tiny, tmp_path):
    again = write_tiny_model(tmp_path / "again", seed=0)
    other = write_tiny_model(tmp_path / "other", seed=1)
    assert digests(again) == digests(tiny)
    d0, d1 = digests(tiny), digests(other)
    assert d0["model.safetensors"] != d1["model.safetensors"]
    assert {f: d for f, d in d0.items() if f != "model.safetensors"} == {f: d for f, d in d1.items() if f != "model.safetensors"}
    w0, w1 = load_file(tiny / "model.safetensors"), load_file(other / "model.safetensors")
    assert w0.keys() == w1.keys()
    assert not torch.equal(w0["model.layers.0.self_attn.q_proj.weight"], w1["model.layers.0.self_attn.q_proj.weight"])


def test_config_describes_the_weights(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["vocab_size"] == tok.get_vocab_size() and 2000 <= cfg["vocab_size"] <= 4096
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (BOS, EOS, PAD)
    assert cfg["max_position_embeddings"] == 4096
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    assert cfg["head_dim"] in (32, 64, 128)  # head sizes vLLM's CPU attention supports
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert gen["eos_token_id"] == EOS

    h, hd, layers = cfg["hidden_size"], cfg["head_dim"], cfg["num_hidden_layers"]
    w = load_file(tiny / "model.safetensors")
    assert len(w) == 2 + 9 * layers + 1
    assert w["model.embed_tokens.weight"].shape == w["lm_head.weight"].shape == (cfg["vocab_size"], h)
    assert w[f"model.layers.{layers - 1}.self_attn.q_proj.weight"].shape == (cfg["num_attention_heads"] * hd, h)
    assert w["model.layers.0.self_attn.k_proj.weight"].shape == (cfg["num_key_value_heads"] * hd, h)
    assert w["model.layers.0.mlp.down_proj.weight"].shape == (h, cfg["intermediate_size"])
    assert {t.dtype for t in w.values()} == {getattr(torch, cfg["torch_dtype"])}
    assert all(torch.isfinite(t.float()).all() for t in w.values())


def test_tokenizer_round_trips_and_adds_bos(tiny):
    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    for text in TEXTS:
        enc = tok.encode(text)
        assert enc.ids[0] == BOS and BOS not in enc.ids[1:]
        assert tok.decode(enc.ids, skip_special_tokens=True) == text
        assert tok.encode(text, add_special_tokens=False).ids == enc.ids[1:]
    # trained on English: common words are single tokens
    assert len(tok.encode(" the", add_special_tokens=False).ids) == 1
    assert [tok.token_to_id(t) for t in ("<pad>", "<s>", "</s>")] == [PAD, BOS, EOS]


def test_chat_template_renders_with_special_tokens(tiny):
    cfg = json.loads((tiny / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == ("<s>", "</s>", "<pad>")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)  # as transformers renders
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]
    text = env.from_string(cfg["chat_template"]).render(messages=messages, add_generation_prompt=True,
                                                        bos_token=cfg["bos_token"], eos_token=cfg["eos_token"])
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHello there!</s>\n<|assistant|>\n"
    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    ids = tok.encode(text, add_special_tokens=False).ids  # the template already starts with BOS
    assert ids[0] == BOS and ids.count(BOS) == 1 and ids.count(EOS) == 2
    for role in ("<|system|>", "<|user|>", "<|assistant|>"):
        assert ids.count(tok.token_to_id(role)) == 1


def test_kv_heavy_carries_hundreds_of_mb_per_8k_request(tmp_path):
    per_token = kv_bytes_per_token("kv-heavy")
    assert 256 << 20 <= per_token * 8192 <= 1 << 30
    assert kv_bytes_per_token("tiny") * 8192 < 16 << 20
    path = write_tiny_model(tmp_path / "kv", size="kv-heavy")
    cfg = json.loads((path / "config.json").read_text())
    s = SIZES["kv-heavy"]
    assert (cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]) == (s.layers, s.kv_heads, s.head_dim)
    assert cfg["max_position_embeddings"] >= 8192 + 1024  # an 8k prompt plus output fits
    with safe_open(str(path / "model.safetensors"), "pt") as f:  # headers only: 170 MB of weights stay on disk
        names = list(f.keys())
        assert f.get_slice(f"model.layers.{s.layers - 1}.self_attn.v_proj.weight").get_shape() == [s.kv_heads * s.head_dim, s.hidden]
    assert len(names) == 2 + 9 * s.layers + 1


def test_cli_writes_refuses_to_clobber_and_forces(tmp_path):
    runner = CliRunner()
    target = tmp_path / "m"
    first = runner.invoke(app, ["tiny", str(target), "--seed", "3"])
    assert first.exit_code == 0, first.output
    assert sorted(p.name for p in target.iterdir()) == sorted(FILES)
    again = runner.invoke(app, ["tiny", str(target)])
    assert again.exit_code == 1 and "--force" in again.output
    forced = runner.invoke(app, ["tiny", str(target), "--seed", "3", "--force"])
    assert forced.exit_code == 0
    assert digests(target) == digests(write_tiny_model(tmp_path / "same", seed=3))
    assert runner.invoke(app, ["tiny", str(tmp_path / "x"), "--size", "huge"]).exit_code == 2

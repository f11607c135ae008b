"""Random-weight LoRA adapters for a checkpoint (tests, benchmarks): PEFT's own ``save_pretrained``, so the
directory is what a fine-tune leaves (adapter_config.json, adapter_model.safetensors). PEFT starts B at zero
(an adapter that changes nothing); here both A and B are drawn from ``seed``, so greedy output differs from the
base model's and from another seed's. Needs ``peft`` (the test extra's; scripts/install.sh installs it without
its dependencies, torch stays as it is)."""

from __future__ import annotations

from pathlib import Path

TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")


def write_adapter(model_dir: str | Path, out: str | Path, seed: int = 1, rank: int = 8, scale: float = 0.5,
                  targets: tuple[str, ...] = TARGETS) -> Path:
    """Write a LoRA adapter of ``rank`` for the checkpoint in ``model_dir`` into ``out``; returns ``out``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                                                  lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    out = Path(out)
    peft_model.save_pretrained(str(out))
    return out

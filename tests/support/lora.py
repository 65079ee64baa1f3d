"""PEFT adapters for the adapter tests, made here with seeded weights (no download)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import peft
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

__all__ = ["make_adapter", "mis_shaped"]


def make_adapter(model_path: Path, config: dict[str, Any], seed: int, target: Path, scale: float = 0.3) -> Path:
    """A PEFT LoRA adapter of the model at ``model_path`` (``config``: LoraConfig's fields), saved
    to ``target``. Its lora_B is drawn from ``seed`` times ``scale``: PEFT starts B at zero, an
    adapter that would change nothing."""
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(**config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    model.save_pretrained(target)
    return target


def mis_shaped(good: Path, target: Path) -> Path:
    """``good`` with every lora_A twice as wide as its base Linear: refused ``shape_mismatch``."""
    target.mkdir(parents=True)
    (target / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    tensors = load_file(good / "adapter_model.safetensors")
    save_file(
        {k: torch.cat([v, v], dim=1) if "lora_A" in k else v for k, v in tensors.items()},
        target / "adapter_model.safetensors",
    )
    return target

"""A LoRA job's adapters as a PEFT adapter directory (`adapter_config.json` and
`adapter_model.safetensors`), which `peft.PeftModel.from_pretrained` puts on the
Hugging Face export of the base model with no custom code."""

from __future__ import annotations

import json
import os
from typing import Optional

import torch
from safetensors.torch import save_file

from lmforge.models import hf
from lmforge.models.config import ModelConfig
from lmforge.models.lora_config import LINEAR_LAYERS, LoraSpec
from lmforge.models.weights import staged_dir

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_FACTORS = {"lora_a": "lora_A", "lora_b": "lora_B"}


def peft_name(name: str, cfg: ModelConfig) -> str:
    """lmforge's name of a factor to peft's: layers.0.attention.wq.lora_a -> base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight."""
    module, _, factor = name.rpartition(".")
    hf_module = hf.hf_name(f"{module}.weight", cfg.family).removesuffix(".weight")
    return f"base_model.model.{hf_module}.{PEFT_FACTORS[factor]}.weight"


def peft_tensors(adapters: dict[str, torch.Tensor], cfg: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """In peft's names and Hugging Face's rotary layout: B's rows are the update's rows,
    so a q or k projection's B is permuted as its weight is (A is not)."""
    out = {}
    for name, tensor in adapters.items():
        module, _, factor = name.rpartition(".")
        if factor == "lora_b":
            tensor = hf.to_hf_layout(f"{module}.weight", tensor, cfg)
        out[peft_name(name, cfg)] = tensor.detach().to("cpu", dtype).contiguous()
    return out


def write_peft_dir(
    out: str | os.PathLike, cfg: ModelConfig, lora: LoraSpec, adapters: dict[str, torch.Tensor], dtype: torch.dtype, base: Optional[str]
) -> None:
    """Atomically, as every export is; `base` is recorded as peft's `base_model_name_or_path`."""
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(LINEAR_LAYERS[t] for t in lora.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
        "base_model_name_or_path": base,
    }
    with staged_dir(out) as staging:
        save_file(peft_tensors(adapters, cfg, dtype), str(staging / WEIGHTS), metadata={"format": "pt"})
        (staging / CONFIG).write_text(json.dumps(config, indent=2) + "\n")

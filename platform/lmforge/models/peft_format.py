"""A LoRA job's adapters as a PEFT adapter directory (`adapter_config.json` and
`adapter_model.safetensors`), which `peft.PeftModel.from_pretrained` puts on the
Hugging Face export of the base model with no custom code; and such a directory read
back (JSON and safetensors only) for serving on lmforge's model."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

from lmforge.jsonfile import read_object
from lmforge.models import hf
from lmforge.models.config import ModelConfig
from lmforge.models.lora_config import HF_TO_LMFORGE, LINEAR_LAYERS, LoraSpec, adapter_shapes
from lmforge.models.weights import staged_dir, weight_shapes

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


@dataclass
class Adapter:
    """A PEFT LoRA directory in lmforge's names and layout: the update of each adapted
    layer is `scaling * B @ A`."""

    rank: int
    scaling: float
    factors: dict[str, torch.Tensor]  # "layers.0.attention.wq.lora_a" -> A (rank, in); "...lora_b" -> B (out, rank)


def read_peft_dir(path: str | os.PathLike, cfg: ModelConfig) -> Adapter:
    """ValueError naming the file for what is not a LoRA adapter of this model's shape."""
    path = Path(path)
    config_file, weights_file = path / CONFIG, path / WEIGHTS
    for file in (config_file, weights_file):
        if not file.is_file():
            raise ValueError(f"{path}: not a PEFT adapter directory (no {file.name})")
    config = read_object(config_file)
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{config_file}: peft_type {config.get('peft_type')!r}; only LORA adapters are served")
    for key, plain in (("fan_in_fan_out", False), ("use_dora", False), ("bias", "none")):
        if config.get(key, plain) != plain:
            raise ValueError(f"{config_file}: {key} {config[key]!r} is not supported (only {plain!r})")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise ValueError(f"{config_file}: r and lora_alpha must be a positive integer and a number")
    targets = config.get("target_modules")
    targets = [targets] if isinstance(targets, str) else targets
    unknown = [t for t in targets or [] if t not in HF_TO_LMFORGE]
    if not targets or unknown:
        raise ValueError(f"{config_file}: target_modules {targets!r}: lmforge serves adapters on {', '.join(HF_TO_LMFORGE)}")
    spec = LoraSpec(rank=rank, alpha=alpha, targets=targets)
    scaling = alpha / rank**0.5 if config.get("use_rslora") else spec.scaling
    expected = adapter_shapes(weight_shapes(cfg), spec)
    by_peft_name = {peft_name(name, cfg): name for name in expected}
    factors = {}
    with hf.open_safetensors(weights_file) as f:
        for key in f.keys():
            name = by_peft_name.get(key.replace(".default.", ".")) if key.startswith("base_model.model.") else None
            if name is None:
                raise ValueError(f"{weights_file}: {key} is not an adapter of this model's {', '.join(targets)} layers")
            tensor = f.get_tensor(key).float()
            if tuple(tensor.shape) != expected[name]:
                raise ValueError(f"{weights_file}: {key} has shape {list(tensor.shape)}, this model needs {list(expected[name])}")
            module, _, factor = name.rpartition(".")
            factors[name] = hf.from_hf_layout(f"{module}.weight", tensor, cfg) if factor == "lora_b" else tensor
    missing = sorted(set(expected) - set(factors))
    if missing:
        raise ValueError(f"{weights_file}: lacks {peft_name(missing[0], cfg)} for its target_modules")
    return Adapter(rank, scaling, factors)

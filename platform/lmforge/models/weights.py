"""lmforge's model format: a directory with `config.json` (the model's shape) and
`model.safetensors` (full fp32 weights named as in the plain `Transformer`).

Both engines export to it and can start from it (`model.init_from`), so weights
move between them without pickles.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lmforge.models.config import ModelConfig

CONFIG, WEIGHTS = "config.json", "model.safetensors"
# Prefixes that wrappers (activation checkpointing, torch.compile) add to names.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def weight_names(cfg: ModelConfig) -> list[str]:
    """The tensors an export holds; a tied output head is the embedding, stored once."""
    from lmforge.models.llama import Transformer  # llama imports this module

    with torch.device("meta"):
        names = list(Transformer(cfg).state_dict())
    return [n for n in names if not (cfg.tie_embeddings and n == "output.weight")]


def save_weights(out: str | os.PathLike, cfg: ModelConfig, tensors: dict[str, torch.Tensor], source: dict) -> None:
    """Write atomically: a staging directory renamed into place, so `out` is whole or absent."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} already exists")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        weights = {clean_name(k): v.detach().to("cpu", torch.float32).contiguous() for k, v in tensors.items()}
        save_file(weights, str(staging / WEIGHTS))
        (staging / CONFIG).write_text(json.dumps({"model": cfg.as_dict(), "source": source}, indent=2) + "\n")
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def read_config(path: str | os.PathLike) -> dict:
    """The exported model's shape; raises ValueError naming what is wrong."""
    path = Path(path)
    if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
        raise ValueError(f"{path} is not an exported model (needs {CONFIG} and {WEIGHTS})")
    try:
        return json.loads((path / CONFIG).read_text())["model"]
    except (json.JSONDecodeError, KeyError) as err:
        raise ValueError(f"{path / CONFIG} is unreadable ({err})") from None


def load_weights_into(model: nn.Module, path: str | os.PathLike) -> None:
    """Copy exported weights into a materialized model or pipeline stage (only the
    parameters it holds; every one of them must be in the file)."""
    tensors = load_file(str(Path(path) / WEIGHTS))
    with torch.no_grad():
        for name, param in model.named_parameters():
            key = clean_name(name)
            if key == "output.weight" and key not in tensors:
                key = "tok_embeddings.weight"  # tied
            param.copy_(tensors[key])

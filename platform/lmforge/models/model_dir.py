"""A model directory's shape from its config.json, in either format: lmforge's own
(a `model` section) or Hugging Face's (a `model_type`). No torch import."""

from __future__ import annotations

from pathlib import Path

from lmforge.jsonfile import read_object
from lmforge.models.config import ModelConfig, config_from_dict
from lmforge.models.hf_config import CONFIG, config_from_hf, is_hf_dir


def read_model_config(path: str | Path) -> tuple[str, ModelConfig]:
    """("lmforge" or "hf", the shape) of a model directory, from its config.json alone;
    ValueError naming the file."""
    file = Path(path) / CONFIG
    if not file.is_file():
        raise ValueError(f"{path}: not a model directory (no {CONFIG})")
    config = read_object(file)
    if is_hf_dir(path):
        return "hf", config_from_hf(config, str(file))
    if "model" not in config:
        raise ValueError(f"{file}: neither lmforge's nor Hugging Face's model config (no `model` section, no `model_type`)")
    return "lmforge", config_from_dict(config["model"], str(file))

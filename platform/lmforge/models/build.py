"""Make a model: built on the meta device (no memory), then allocated where asked
and initialized, seeded or from a model directory (lmforge's format or Hugging Face's)."""

from __future__ import annotations

import torch

from lmforge.models.config import ModelConfig
from lmforge.models.llama import Transformer
from lmforge.models.weights import Weights, load_weights_into


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", seed: int = 0, weights: Weights | None = None) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    return materialize(model, device, seed, weights)


def materialize(model: Transformer, device: str | torch.device, seed: int, weights: Weights | None = None) -> Transformer:
    """Allocate a meta-device model (or pipeline stage) on `device` and initialize it:
    seeded, or from `weights` (a model directory, or tensors in lmforge's names)."""
    model.to_empty(device=device)
    if model.cfg.tie_embeddings and model.output is not None and model.tok_embeddings is not None:
        model.output.weight = model.tok_embeddings.weight  # to_empty breaks the tie
    if weights is None:
        model.init_weights(seed)
    else:
        load_weights_into(model, weights)
        model.reset_rope()
    return model

"""Dynamic loss scaling for fp16 (Micikevicius et al. 2018, "Mixed Precision
Training"; torch's GradScaler and DeepSpeed's fp16 optimizer follow it): the loss is
multiplied by the scale before backward so small gradients survive fp16, and the
gradients are divided by it before clipping and the update. A step whose gradients
overflowed is skipped and the scale halved; after `growth_interval` clean steps in a
row it doubles. Whether a step overflowed is read from the global gradient norm,
which every rank computes alike whatever the layout (FSDP shards, TP, pipeline
stages), so every rank skips the same steps."""

from __future__ import annotations

import math

import torch

INITIAL_SCALE = 2.0**16
GROWTH_INTERVAL = 2000
MIN_SCALE = 1.0


class LossScale:
    def __init__(self, scale: float = INITIAL_SCALE, growth_interval: int = GROWTH_INTERVAL):
        self.scale, self.growth_interval = scale, growth_interval
        self.clean_steps = 0

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    @torch.no_grad()
    def unscale(self, grads: list[torch.Tensor]) -> None:
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, grad_norm: float) -> bool:
        """After a step's gradients are unscaled and their global norm is known:
        whether they overflowed (then the update is to be skipped)."""
        if not math.isfinite(grad_norm):
            self.scale, self.clean_steps = max(self.scale / 2, MIN_SCALE), 0
            return True
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale, self.clean_steps = self.scale * 2, 0
        return False

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])

"""Engines: one file each behind the small `Engine` interface in `base.py`, each
holding the job's `Loss` (`loss.py`; cross-entropy unless one is given)."""

from typing import Optional

from lmforge.engines.base import Engine, StepStats
from lmforge.engines.deepspeed import DeepSpeedEngine
from lmforge.engines.loss import CrossEntropy, Loss
from lmforge.engines.native import NativeEngine


def create_engine(spec, dims, device, loss: Optional[Loss] = None) -> Engine:
    loss = loss or CrossEntropy()
    if spec.engine == "native":
        return NativeEngine(spec, dims, device, loss)
    if spec.engine == "deepspeed":  # DeepSpeed itself is imported only by jobs that use it
        return DeepSpeedEngine(spec, dims, device, loss)
    raise ValueError(f"unknown engine {spec.engine!r}")


__all__ = ["CrossEntropy", "Engine", "Loss", "StepStats", "create_engine"]

"""Engines: one file each behind the small `Engine` interface in `base.py`."""

from lmforge.engines.base import Engine, StepStats


def create_engine(spec, dims, device, vocab=None) -> Engine:
    """`vocab`: the tokenizer's real vocabulary (distillation compares no more of it)."""
    if spec.engine == "native":
        from lmforge.engines.native import NativeEngine

        return NativeEngine(spec, dims, device, vocab)
    if spec.engine == "deepspeed":
        from lmforge.engines.deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(spec, dims, device, vocab)
    raise ValueError(f"unknown engine {spec.engine!r}")


__all__ = ["Engine", "StepStats", "create_engine"]

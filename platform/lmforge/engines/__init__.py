"""Engines: one file each behind the small `Engine` interface in `base.py`."""

from lmforge.engines.base import Engine, StepStats


def create_engine(spec, dims, device) -> Engine:
    if spec.engine == "native":
        from lmforge.engines.native import NativeEngine

        return NativeEngine(spec, dims, device)
    if spec.engine == "deepspeed":
        from lmforge.engines.deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(spec, dims, device)
    raise ValueError(f"unknown engine {spec.engine!r}")


__all__ = ["Engine", "StepStats", "create_engine"]

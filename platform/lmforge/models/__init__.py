"""Models: plain `nn.Module`s with no parallelism code inside.

`build_model` makes one on the meta device and materializes it where asked. The
module itself is imported on first use, so `lmforge.models.config` (the shapes the
job file and the controller read) costs no torch import.
"""

from lmforge.models.config import PRESETS, ModelConfig

__all__ = ["PRESETS", "ModelConfig", "Transformer", "build_model", "materialize"]


def __getattr__(name: str):
    if name == "Transformer":
        from lmforge.models.llama import Transformer

        return Transformer
    if name in ("build_model", "materialize"):
        from lmforge.models import build

        return getattr(build, name)
    raise AttributeError(f"module 'lmforge.models' has no attribute {name!r}")

"""Models: plain `nn.Module`s with no parallelism code inside.

`build_model` makes one on the meta device and materializes it where asked.
"""

from lmforge.models.config import PRESETS, ModelConfig
from lmforge.models.llama import Transformer, build_model, materialize

__all__ = ["PRESETS", "ModelConfig", "Transformer", "build_model", "materialize"]

"""Model directories: lmforge's own format (`config.json` with the model's shape,
`model.safetensors` with fp32 weights named as in the plain `Transformer`) and
Hugging Face Llama directories (`lmforge.models.hf`). Either may carry a tokenizer.

Both engines export to them and start from them (`model.init_from`); nothing in
them is a pickle.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Optional, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from lmforge.models import hf
from lmforge.models.config import ModelConfig
from lmforge.models.hf_config import config_to_hf
from lmforge.models.llama import Transformer
from lmforge.models.model_dir import read_model_config

CONFIG, WEIGHTS, TOKENIZER = "config.json", "model.safetensors", "tokenizer.json"
# Prefixes that wrappers (activation checkpointing, torch.compile) add to names.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")
Weights = Union[str, os.PathLike, Mapping[str, torch.Tensor]]  # a model directory, or tensors in lmforge's names


def clean_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """The tensors a model file holds, and their shapes; a tied output head is the
    embedding, stored once."""
    with torch.device("meta"):
        state = Transformer(cfg).state_dict()
    return {n: tuple(t.shape) for n, t in state.items() if not (cfg.tie_embeddings and n == "output.weight")}


def weight_names(cfg: ModelConfig) -> list[str]:
    return list(weight_shapes(cfg))


@dataclass
class ModelDir:
    """An opened model directory of either format; tensors are read on demand, in
    lmforge's names and layout."""

    path: Path
    format: str  # "lmforge" or "hf"
    cfg: ModelConfig
    _hf: Optional[hf.HFFiles] = None

    @property
    def tokenizer_file(self) -> Optional[Path]:
        return self.path / TOKENIZER if (self.path / TOKENIZER).is_file() else None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: self.tensor(name) for name in weight_names(self.cfg)}

    def tensor(self, name: str) -> torch.Tensor:
        file, key = self._locate(name)
        with safe_open(str(file), framework="pt") as f:
            tensor = f.get_tensor(key)
        return hf.from_hf_layout(name, tensor, self.cfg) if self._hf else tensor

    def _locate(self, name: str) -> tuple[Optional[Path], str]:
        return self._hf.locate(name) if self._hf else (self.path / WEIGHTS, name)

    def check(self) -> "ModelDir":
        """Every tensor the config implies is there, of its shape (headers only: nothing is read)."""
        by_file: dict[Path, list[tuple[str, tuple]]] = {}
        for name, shape in weight_shapes(self.cfg).items():
            file, key = self._locate(name)
            if file is None:
                raise ValueError(f"{self.path}: no file holds {key}, which the model its config.json describes needs")
            by_file.setdefault(file, []).append((key, shape))
        for file, wanted in by_file.items():
            with hf.open_safetensors(file) as f:
                keys = set(f.keys())
                for key, shape in wanted:
                    if key not in keys:
                        raise ValueError(f"{file}: lacks {key} for the model its config.json describes")
                    found = tuple(f.get_slice(key).get_shape())
                    if found != shape:
                        raise ValueError(f"{file}: {key} has shape {list(found)}, config.json implies {list(shape)}")
        return self


def open_model_dir(path: str | os.PathLike) -> ModelDir:
    """Its format, shape and weights checked (names and shapes, nothing loaded yet);
    ValueError naming the file that is missing or wrong."""
    path = Path(path)
    if (path / "quantization.json").is_file():
        raise ValueError(f"{path}: a quantized model directory holds no full-precision weights; it loads in lmforge generate and lmforge serve")
    fmt, cfg = read_model_config(path)
    if fmt == "hf":
        if not (path / TOKENIZER).is_file():
            raise ValueError(f"{path}: a Hugging Face directory without its {TOKENIZER}")
        return ModelDir(path, "hf", cfg, hf.HFFiles(path, cfg.family)).check()
    if not (path / WEIGHTS).is_file():
        raise ValueError(f"{path}: an lmforge model directory without {WEIGHTS}")
    return ModelDir(path, "lmforge", cfg).check()


def write_model_dir(
    out: str | os.PathLike,
    fmt: str,
    cfg: ModelConfig,
    tensors: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype = torch.float32,
    eos_id: Optional[int] = None,
    source: Optional[dict] = None,
    files: Optional[dict[str, str]] = None,
) -> None:
    """Write atomically (a staging directory renamed into place, so `out` is whole or
    absent). `tensors` are in lmforge's names; `files` are written beside them."""
    with staged_dir(out) as staging:
        tensors = {clean_name(k): v.detach().to("cpu", dtype).contiguous() for k, v in tensors.items()}
        if fmt == "hf":
            tensors = {hf.hf_name(k, cfg.family): hf.to_hf_layout(k, v, cfg).contiguous() for k, v in tensors.items()}
            config = config_to_hf(cfg, eos_id, str(dtype).removeprefix("torch."))
            generation = {"bos_token_id": eos_id, "eos_token_id": eos_id}
            (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        else:
            config = {"model": cfg.as_dict(), "source": source or {}}
        save_file(tensors, str(staging / WEIGHTS), metadata={"format": "pt"})
        (staging / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        for name, text in (files or {}).items():
            (staging / name).write_text(text)


@contextmanager
def staged_dir(out: str | os.PathLike) -> Iterator[Path]:
    """A staging directory beside `out`, renamed to it when the block ends without an
    error (so `out` is whole or absent); FileExistsError if `out` exists."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} already exists")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield staging
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_weights_into(model: nn.Module, weights: Weights) -> None:
    """Copy weights into a materialized model or pipeline stage (only the parameters it
    holds; every one of them must be there)."""
    tensor = weights.__getitem__ if isinstance(weights, Mapping) else open_model_dir(weights).tensor
    with torch.no_grad():
        for name, param in model.named_parameters():
            key = clean_name(name)
            if key == "output.weight" and model.cfg.tie_embeddings:
                key = "tok_embeddings.weight"
            param.copy_(tensor(key))

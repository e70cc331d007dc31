"""`lmforge quantize`: weight-only int8 (per output channel) or int4 (group-wise) for
the transformer blocks' Linear layers, with torchao; embeddings, norms and the output
head stay in the model's dtype. A quantized directory holds plain tensors in
safetensors (each torchao tensor as its parts) and `quantization.json`; it loads by
quantizing a fresh model the same way and copying the parts in, never by unpickling.

torchao's int4 differs by device: on CPU its `Int4WeightOnlyConfig` needs kernels
this build lacks, so int4 uses `Int4WeightOnlyQuantizer` (packed uint8, fp32 scales
and zeros, torch's `_weight_int4pack_mm_for_cpu`); its packing is the device's, so an
int4 directory loads on the device kind it was made on.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from lmforge.data.tokenizer import tokenizer_files
from lmforge.errors import UserError
from lmforge.jsonfile import member, read_object
from lmforge.models.build import build_model
from lmforge.models.config import config_from_dict

METHODS = ("int8", "int4")
GROUP_SIZES = (32, 64, 128, 256)
QUANTIZATION = "quantization.json"
WEIGHTS = "model.safetensors"
PART = ":"  # "<parameter>:<part>" names a torchao tensor's part in the file


def is_quantized(path: str | os.PathLike) -> bool:
    return (Path(path) / QUANTIZATION).is_file()


def quantize_blocks(model, method: str, group_size: int) -> None:
    """In place: every Linear inside the transformer blocks."""
    device = next(model.parameters()).device
    if method == "int8":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(model.layers, Int8WeightOnlyConfig())
    else:
        from torchao.quantization import Int4WeightOnlyQuantizer

        # The packing wants rows in 16s and columns in whole groups (and the kernel's
        # 128-wide tiles): a Linear that is not so is padded with zeros around it.
        _pad_linears(model.layers, rows=16, columns=max(group_size, INT4_TILE))
        # bf16 is what its CUDA kernel takes (not run here: no GPU); fp32 on CPU.
        precision = torch.bfloat16 if device.type == "cuda" else torch.float32
        Int4WeightOnlyQuantizer(groupsize=group_size, device=device, precision=precision).quantize(model.layers)


INT4_TILE = 128  # inner_k_tiles (8) x 16


class PaddedLinear(torch.nn.Module):
    """A Linear with zero rows and columns added: the input padded with zeros to its
    width, the output cut back to the original's, then its bias (kept here: torchao's
    int4 Linear has none) added."""

    def __init__(self, linear: torch.nn.Linear, in_features: int, out_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        self.linear, self.in_features, self.out_features = linear, in_features, out_features
        self.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.pad(x, (0, self.linear.in_features - self.in_features))
        out = self.linear(x)[..., : self.out_features]
        return out + self.bias if self.bias is not None else out


def _pad_linears(module: torch.nn.Module, rows: int, columns: int) -> None:
    for name, child in list(module.named_children()):
        if not isinstance(child, torch.nn.Linear):
            _pad_linears(child, rows, columns)
            continue
        out, in_ = -(-child.out_features // rows) * rows, -(-child.in_features // columns) * columns
        if (out, in_) == (child.out_features, child.in_features) and child.bias is None:
            continue
        padded = torch.nn.Linear(in_, out, bias=False, device=child.weight.device, dtype=child.weight.dtype)
        with torch.no_grad():
            padded.weight.zero_()
            padded.weight[: child.out_features, : child.in_features] = child.weight
        setattr(module, name, PaddedLinear(padded, child.in_features, child.out_features, child.bias))


def _is_torchao(tensor: torch.Tensor) -> bool:
    from torchao.utils import TorchAOBaseTensor

    return isinstance(tensor, TorchAOBaseTensor)


def stored_tensors(model) -> dict[str, torch.Tensor]:
    """What a quantized directory stores: plain tensors, a torchao tensor as its parts
    (each the model's own storage, so that a load can copy into it)."""
    out = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name == "output.weight" and model.cfg.tie_embeddings:
            continue  # the embedding's
        if _is_torchao(tensor):
            names, _ = tensor.__tensor_flatten__()
            out |= {f"{name}{PART}{part}": getattr(tensor, part).detach() for part in names}
        else:
            out[name] = tensor.detach()
    return out


def load_quantized(path: Path, device: str):
    """A quantized directory's model, on `device` (UserError naming the file when it does not fit)."""
    from safetensors.torch import load_file

    try:
        record = read_object(path / QUANTIZATION)
        cfg = config_from_dict(member(read_object(path / "config.json"), "model", dict, str(path / "config.json")), str(path / "config.json"))
        method, group_size = (
            member(record, "method", str, str(path / QUANTIZATION)),
            member(record, "group_size", (int, type(None)), str(path / QUANTIZATION)),
        )
    except ValueError as err:
        raise UserError(str(err)) from None
    if record.get("device_type", "cpu") != torch.device(device).type and method == "int4":
        raise UserError(
            f"{path / QUANTIZATION}: int4 weights packed for {record['device_type']} do not load on {device}; quantize on the device that will serve"
        )
    model = build_model(cfg, device)
    quantize_blocks(model, method, group_size)
    saved = load_file(str(path / WEIGHTS), device=str(device))
    wanted = stored_tensors(model)
    if set(saved) != set(wanted):
        missing, extra = sorted(set(wanted) - set(saved)), sorted(set(saved) - set(wanted))
        raise UserError(f"{path / WEIGHTS}: does not match {QUANTIZATION} and config.json (missing {missing[:3]}, unexpected {extra[:3]})")
    with torch.no_grad():
        for name, target in wanted.items():
            if target.shape != saved[name].shape:
                raise UserError(f"{path / WEIGHTS}: {name} has shape {list(saved[name].shape)}, expected {list(target.shape)}")
            target.copy_(saved[name])  # the model's own storage: parts are views of it
    model.reset_rope()
    return model.eval()


def linear_weight_names(model) -> list[str]:
    """Before quantizing: the weights it will replace."""
    return [f"layers.{name}.weight" for name, module in model.layers.named_modules() if isinstance(module, torch.nn.Linear)]


def write_quantized(out: Path, source, model, method: str, group_size: int) -> dict:
    """Atomically (a staging directory renamed into place). Returns the byte counts."""
    from safetensors.torch import save_file

    tensors = stored_tensors(model)
    record = {
        "method": method,
        "group_size": group_size if method == "int4" else None,
        "library": _library(method),
        "device_type": next(model.parameters()).device.type,
        "quantized": "transformer blocks' Linear weights",
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, str(staging / WEIGHTS), metadata={"format": "lmforge-quantized"})
        (staging / "config.json").write_text(json.dumps({"model": source.cfg.as_dict(), "source": source.record}, indent=2) + "\n")
        (staging / QUANTIZATION).write_text(json.dumps(record, indent=2) + "\n")
        if source.tokenizer_json is not None:
            for name, text in tokenizer_files(source.tokenizer_json, source.eos_token, source.cfg.max_seq_len).items():
                (staging / name).write_text(text)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return record


def _library(method: str) -> str:
    import torchao

    scheme = "Int8WeightOnlyConfig via quantize_" if method == "int8" else "Int4WeightOnlyQuantizer (WeightOnlyInt4Linear)"
    return f"torchao {torchao.__version__}: {scheme}"


def byte_counts(model, quantized_tensors: dict[str, torch.Tensor], linear_names: list[str], numels: dict[str, int]) -> dict:
    """Bytes of the blocks' Linear weights and of the whole model, quantized and as bf16."""
    whole = sum(t.nbytes for t in quantized_tensors.values())
    kept = set(numels) - set(linear_names)  # embeddings, norms, the output head: stored as they were
    linear = whole - sum(t.nbytes for name, t in quantized_tensors.items() if name in kept)
    linear_bf16 = 2 * sum(numels[name] for name in linear_names)
    whole_bf16 = 2 * sum(n for name, n in numels.items() if not (name == "output.weight" and model.cfg.tie_embeddings))
    return {
        "linear_bytes": linear,
        "linear_bytes_bf16": linear_bf16,
        "linear_ratio_vs_bf16": linear / linear_bf16,
        "model_bytes": whole,
        "model_bytes_bf16": whole_bf16,
        "model_ratio_vs_bf16": whole / whole_bf16,
    }

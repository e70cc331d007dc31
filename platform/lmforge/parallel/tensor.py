"""Tensor parallelism with DTensor: the Megatron split of every block, applied from outside.

Attention and MLP input projections are column-parallel and output projections
row-parallel; the embedding is sharded over the vocabulary and the output head
produces vocabulary-sharded logits for loss parallelism. With sequence
parallelism the norms and residual stream are sharded along the sequence.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lmforge.models.lora import LoraLinear
from lmforge.models.lora_config import ADAPTER_PARAMS

# The Megatron split of a block, declared once: the engine applies it and the memory
# estimator reads which dim of each weight it cuts (colwise: dim 0, rowwise: dim 1).
COLWISE = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
ROWWISE = ("attention.wo", "feed_forward.w2")


def shard_dim(param_name: str) -> int | None:
    """The dim of a parameter that tensor parallelism splits; None: replicated.
    The embedding and the output head are both split over the vocabulary; a
    column-parallel projection's bias with its columns. A LoRA update B @ A is split
    as its layer's weight is: B (out, rank) by rows in a column-parallel layer, A
    (rank, in) by columns in a row-parallel one; the other factor is replicated."""
    module, _, kind = param_name.rpartition(".")
    if module in ("tok_embeddings", "output"):
        return 0
    if module.endswith(COLWISE):
        return None if kind == "lora_a" else 0
    if module.endswith(ROWWISE):
        return 1 if kind in ("weight", "lora_a") else None
    return None


def _replicate(module: nn.Module, mesh: DeviceMesh, inputs_are: Placement | None = None) -> None:
    """Parameters as replicated DTensors, plain tensors in and out: keeps every
    parameter on the TP mesh (one mesh for grad clipping and FSDP) without SP.
    `inputs_are`: what each rank's plain input is of the whole: with Shard, weight
    gradients add up over the TP ranks' parts."""

    def to_dtensor(_mod, inputs, device_mesh):
        return tuple(DTensor.from_local(x, device_mesh, [inputs_are or Replicate()], run_check=False) for x in inputs)

    def to_local(_mod, output, _device_mesh):
        return output.to_local()

    distribute_module(module, mesh, input_fn=to_dtensor, output_fn=to_local)


def replicate_beside_blocks(module: nn.Module, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """A module applied to blocks' outputs (distillation's adapters): replicated
    parameters; its plain-tensor inputs are the residual stream, whole or (with SP)
    this rank's part of the sequence, so weight gradients add up over the TP ranks'
    parts. Plain tensors out."""
    residual = Shard(1) if sequence_parallel else Replicate()

    def to_dtensor(_mod, inputs, device_mesh):
        return tuple(DTensor.from_local(x, device_mesh, [residual], run_check=False) for x in inputs)

    def to_local(_mod, outputs, _device_mesh):
        return tuple(x.to_local() for x in outputs)

    distribute_module(module, mesh, input_fn=to_dtensor, output_fn=to_local)


def _place_adapters(block: nn.Module, mesh: DeviceMesh) -> None:
    """LoRA factors as `shard_dim` says (the layer's plan distributed them as if they
    were its weight): sharded outputs and partial sums then add up with the base layer's."""
    for name, module in block.named_modules():
        if not isinstance(module, LoraLinear):
            continue
        for kind in ADAPTER_PARAMS:
            dim = shard_dim(f"{name}.{kind}")
            value = getattr(module, kind)
            whole = value.full_tensor() if isinstance(value, DTensor) else value
            module.register_parameter(kind, nn.Parameter(distribute_tensor(whole.detach(), mesh, [Replicate() if dim is None else Shard(dim)])))


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    # The plans make new parameters that all require gradients: frozen ones (LoRA's base) are frozen again after.
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    _apply_plans(model, tp_mesh, sequence_parallel)
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)


def _apply_plans(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    residual = Shard(1) if sequence_parallel else Replicate()
    # A pipeline stage lacks (None) the embedding, or the norm and head, it does not own.
    if model.tok_embeddings is not None:
        parallelize_module(model.tok_embeddings, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=residual))
    if model.output is not None:
        parallelize_module(model.output, tp_mesh, ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False))
    if model.norm is not None and sequence_parallel:
        parallelize_module(model.norm, tp_mesh, SequenceParallel())
    elif model.norm is not None:
        _replicate(model.norm, tp_mesh)
    for block in model.layers.values():
        plan = {
            # cos and sin (the 2nd and 3rd inputs) are plain tensors, the same on every rank.
            "attention": PrepareModuleInput(input_layouts=(residual, None, None), desired_input_layouts=(Replicate(), None, None)),
            "feed_forward": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),)),
        }
        plan |= {name: ColwiseParallel() for name in COLWISE} | {name: RowwiseParallel(output_layouts=residual) for name in ROWWISE}
        # Gemma's norms of each branch's output, before it joins the residual stream
        # (plain tensors out, as the residual is).
        out_norms = ["attention_out_norm", "ffn_out_norm"] if block.attention_out_norm is not None else []
        if sequence_parallel:
            plan |= {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
            plan |= {name: SequenceParallel(use_local_output=True) for name in out_norms}
        else:
            for name in ("attention_norm", "ffn_norm", *out_norms):
                _replicate(getattr(block, name), tp_mesh)
        parallelize_module(block, tp_mesh, plan)
        _place_adapters(block, tp_mesh)
        if block.attention.q_norm is not None:  # over each head's features: q and k hold this rank's heads (dim 2)
            _replicate(block.attention.q_norm, tp_mesh, inputs_are=Shard(2))
            _replicate(block.attention.k_norm, tp_mesh, inputs_are=Shard(2))

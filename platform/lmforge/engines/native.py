"""The native engine: a plain model parallelized with PyTorch's own building blocks.

Order of application follows TorchTitan: tensor parallel, activation
checkpointing, then FSDP2. AdamW with warmup + cosine, gradient
accumulation without gradient sync until the last micro-batch, global-norm clipping.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from lmforge.engines.base import Engine, StepStats, warmup_cosine
from lmforge.models import build_model
from lmforge.parallel.checkpointing import apply_activation_checkpointing
from lmforge.parallel.fsdp import apply_fsdp, needs_wrapping
from lmforge.parallel.tensor import apply_tensor_parallel
from lmforge.parallel.mesh import ParallelDims


class NativeEngine(Engine):
    def __init__(self, spec, dims: ParallelDims, device: torch.device):
        self.dims, self.device = dims, device
        model = build_model(spec.model_arch, device=device, seed=spec.train.seed)
        p = spec.parallel
        # TorchTitan's order: tensor parallel, then activation checkpointing, then FSDP.
        self.tensor_parallel = dims.shape.tp > 1
        if self.tensor_parallel:
            apply_tensor_parallel(model, dims.tp_mesh, p.sequence_parallel)
        apply_activation_checkpointing(model, p.activation_checkpointing, p.ac_every)
        self.sharded = needs_wrapping(dims, spec.train.precision)
        if self.sharded:
            model = apply_fsdp(model, dims, p.zero, spec.train.precision)
        self.model = model
        opt = spec.optim
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay,
            foreach=True,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_cosine(opt.warmup_steps, spec.decay_steps, opt.min_lr_ratio)
        )
        self.grad_clip = opt.grad_clip

    def train_step(self, micro_batches: torch.Tensor) -> StepStats:
        self.model.train()
        accum = micro_batches.shape[0]
        loss_sum = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro_batches.to(self.device, non_blocking=True)):
            if self.sharded:
                self.model.set_requires_gradient_sync(i == accum - 1)
            # With TP the logits are vocabulary-sharded DTensors: loss_parallel computes
            # the cross-entropy without gathering them.
            with loss_parallel() if self.tensor_parallel else nullcontext():
                logits = self.model(batch[:, :-1])
                # Every sample has the same token count, so the mean of micro-batch means
                # is the global-batch mean; FSDP averages over DP ranks.
                loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten()) / accum
                loss.backward()
            loss = loss.detach()
            loss_sum += loss.full_tensor() if isinstance(loss, DTensor) else loss
        lr = self.scheduler.get_last_lr()[0]
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip or float("inf"))
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.dims.shape.dp > 1:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG, group=self.dims.dp_group)
        return StepStats(loss=loss_sum.item(), grad_norm=grad_norm.item(), lr=lr)

    def state_dict(self) -> tuple[dict, dict]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        # Tensors go to DCP; the small rest stays JSON so no checkpoint needs unpickling.
        tensors = {"model": model_sd, "optim": optim_sd["state"]}
        plain = {"param_groups": optim_sd["param_groups"], "scheduler": self.scheduler.state_dict()}
        return tensors, plain

    def load_state_dict(self, tensors: dict, plain: dict) -> None:
        optim_sd = {"state": tensors["optim"], "param_groups": plain["param_groups"]}
        set_state_dict(self.model, self.optimizer, model_state_dict=tensors["model"], optim_state_dict=optim_sd)
        self.scheduler.load_state_dict(plain["scheduler"])

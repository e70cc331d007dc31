"""The DeepSpeed engine: the same model and batches, with DeepSpeed's ZeRO (stages
0-3, CPU/NVMe offload) partitioning optimizer state, gradients and parameters.

DeepSpeed runs inside the process group the worker already made; the config is
the job's reconciled one (see `lmforge.deepspeed_config`). Checkpoints are
DeepSpeed's own files inside lmforge's step directory. A distillation's online
teachers are whole, frozen copies on every rank, beside the ZeRO-partitioned student.
"""

from __future__ import annotations

import math
import os
from typing import Callable, Optional

import torch
import torch.distributed as dist

from lmforge.checkpoint.deepspeed_files import CHECKPOINT_TAG, UNIVERSAL_TAG, skip_shared_memory_op, to_universal
from lmforge.checkpoint.state import TrainerState
from lmforge.engines.base import Engine, StepStats, warmup_cosine
from lmforge.engines.loss import Loss, LossInputs, Placement, cross_entropy
from lmforge.engines.loss_mask import learnt_per_rank, next_token_labels
from lmforge.models import build_model
from lmforge.models.lora import apply_lora
from lmforge.parallel.checkpointing import apply_activation_checkpointing
from lmforge.parallel.mesh import ParallelDims


def _credentials_to_environment(config: dict) -> dict:
    """DeepSpeed keeps its config in every checkpoint: a key in it (comet's) goes to the
    rank's environment, where its library reads it, and not into the files."""
    config = dict(config)
    comet = dict(config.get("comet") or {})
    if comet.get("api_key"):
        os.environ["COMET_API_KEY"] = str(comet.pop("api_key"))
        config["comet"] = comet
    return config


class DeepSpeedEngine(Engine):
    checkpoint_format = "deepspeed"

    def __init__(self, spec, dims: ParallelDims, device: torch.device, loss: Loss):
        skip_shared_memory_op()
        import deepspeed

        self.spec, self.dims, self.device, self.loss = spec, dims, device, loss
        config = _credentials_to_environment(spec.deepspeed.config)
        model = build_model(spec.model_arch, device, spec.train.seed, weights=spec.model.init_from)
        if spec.model.lora is not None:
            apply_lora(model, spec.model.lora, spec.train.seed)
        p = spec.parallel
        apply_activation_checkpointing(model, p.activation_checkpointing, p.ac_every)
        scheduler = None if "scheduler" in config else self._warmup_cosine
        self.engine, _, _, _ = deepspeed.initialize(
            model=model,
            model_parameters=[param for param in model.parameters() if param.requires_grad],
            config=dict(config),
            lr_scheduler=scheduler,
            dist_init_required=False,
        )
        # Teachers stay plain frozen modules; the spec refuses what would train beside the student (hidden-state adapters).
        loss.build(Placement(device, lambda teacher: teacher, grad_accum=spec.grad_accum))
        loss.bind(model)

    def _warmup_cosine(self, optimizer: torch.optim.Optimizer):
        opt = self.spec.optim
        return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(opt.warmup_steps, self.spec.decay_steps, opt.min_lr_ratio))

    def train_step(
        self,
        micro_batches: torch.Tensor,
        before_update: Callable[[], None] = lambda: None,
        loss_mask: Optional[torch.Tensor] = None,
        loss_inputs: LossInputs = None,
    ) -> StepStats:
        micro_batches = micro_batches.to(self.device, non_blocking=True)
        before_update()  # DeepSpeed steps inside its backward loop; its checkpoints are synchronous anyway
        self.engine.train()
        lr = self.engine.get_lr()[0]
        if self.loss.rewrites(loss_inputs):  # e.g. the student's continuations replace the data's
            micro_batches, loss_mask = self.loss.rewrite(self.engine, micro_batches, loss_mask, loss_inputs)
        scale, skipped = self._loss_scale(), self.engine.skipped_steps
        loss, terms = self._accumulate(micro_batches, *self._labels(micro_batches, loss_mask), loss_inputs)
        if self.dims.shape.dp > 1:
            reduced = torch.stack([loss, *terms.values()])  # one collective for the loss and its terms
            dist.all_reduce(reduced, op=dist.ReduceOp.AVG, group=self.dims.dp_group)
            loss, terms = reduced[0], dict(zip(terms, reduced[1:]))
        norm = self.engine.get_global_grad_norm()
        grad_norm = float(norm) if norm is not None else float("nan")
        # DeepSpeed has already stepped: fp16's loss scaler skipped an overflowing step
        # itself (no divergence while the loss is finite); any other non-finite step
        # counts towards the guard's rollback.
        overflow = self.engine.skipped_steps > skipped and math.isfinite(loss.item())
        finite = math.isfinite(loss.item()) and not overflow and (norm is None or math.isfinite(grad_norm))
        return StepStats(
            loss=loss.item(),
            grad_norm=grad_norm,
            lr=lr,
            finite=finite,
            update_skipped=overflow,
            overflow=overflow,
            loss_scale=scale,
            next_loss_scale=self._loss_scale(),
            terms={k: v.item() for k, v in terms.items()},
        )

    def _loss_scale(self) -> Optional[float]:
        """fp16: the scale DeepSpeed's optimizer multiplies the loss by now."""
        if self.spec.train.precision != "fp16":
            return None
        return float(getattr(self.engine.optimizer, "loss_scale", 0.0)) or None

    def _labels(self, micro_batches: torch.Tensor, loss_mask) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(next tokens, IGNORE_INDEX where the loss mask is 0; N / dp for a masked batch)."""
        labels = next_token_labels(micro_batches, loss_mask)
        return labels, None if loss_mask is None else learnt_per_rank(labels, self.dims.dp_group, self.dims.shape.dp)

    def _accumulate(self, micro_batches: torch.Tensor, labels: torch.Tensor, learnt, loss_inputs: LossInputs) -> tuple[torch.Tensor, dict]:
        """The step's loss on this rank and its terms, each micro-batch stepped through
        DeepSpeed (which reduces and updates at the last)."""
        loss_sum, term_sums = torch.zeros((), device=self.device), {}
        for i, batch in enumerate(micro_batches):
            loss, terms = self.loss(self.engine, batch[:, :-1], labels[i], i, learnt, len(micro_batches), loss_inputs)
            # Already the micro-batch's share of the step's loss: DeepSpeed must not divide again.
            self.engine.backward(loss, scale_wrt_gas=False)
            self.engine.step()
            loss_sum += loss.detach()
            for name, value in terms.items():
                term_sums[name] = term_sums.get(name, 0) + value.detach()
        return loss_sum, term_sums

    @torch.no_grad()
    def eval_loss(self, micro_batches: torch.Tensor, loss_mask: Optional[torch.Tensor] = None) -> float:
        micro_batches = micro_batches.to(self.device, non_blocking=True)
        self.engine.eval()
        labels, learnt = self._labels(micro_batches, loss_mask)
        if learnt is None:
            loss = torch.stack([cross_entropy(self.engine(batch[:, :-1]), labels[i]) for i, batch in enumerate(micro_batches)]).mean()
        else:
            loss = sum(cross_entropy(self.engine(batch[:, :-1]), labels[i], "sum") for i, batch in enumerate(micro_batches)) / learnt
        if self.dims.shape.dp > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.dims.dp_group)
        return loss.item()

    @torch.no_grad()
    def evaluate(self, micro_batches: torch.Tensor, loss_mask: Optional[torch.Tensor] = None, loss_inputs: LossInputs = None) -> dict[str, float]:
        if not self.loss.measures_held_out:
            return super().evaluate(micro_batches, loss_mask=loss_mask)
        micro_batches = micro_batches.to(self.device, non_blocking=True)
        self.engine.eval()
        labels = next_token_labels(micro_batches, loss_mask)
        sums = torch.zeros(self.loss.held_out_size, device=self.device)
        for i, batch in enumerate(micro_batches):
            sums += self.loss.held_out_sums(self.engine, batch[:, :-1], labels[i], i, loss_inputs)
        return self.loss.held_out_means(sums, self.dims.dp_group if self.dims.shape.dp > 1 else None)

    def modules(self) -> list[torch.nn.Module]:
        return [self.engine.module]

    # Checkpoints: DeepSpeed's files (sharded per rank and stage) under `<step dir>/deepspeed`.
    def save(self, directory: str) -> None:
        self.engine.save_checkpoint(directory, tag=CHECKPOINT_TAG, save_latest=False)

    def load(self, directory: str, saved: TrainerState) -> None:
        """Same DP size: DeepSpeed's own files. Another DP size with ZeRO partitions:
        DeepSpeed's universal checkpoint, converted once (by rank 0) into `<step dir>/universal`."""
        tag = CHECKPOINT_TAG
        # ZeRO stage 0 saves whole optimizer state, which loads on any DP size as is.
        if saved.dp != self.dims.shape.dp and self.engine.zero_optimization_stage() > 0:
            if dist.get_rank() == 0:
                to_universal(directory)
            dist.barrier()
            self.engine._config.load_universal_checkpoint = True  # DeepSpeed reads it from the config at load
            tag = UNIVERSAL_TAG
        path, _ = self.engine.load_checkpoint(directory, tag=tag, load_module_strict=True)
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint under {directory}/{tag}")

"""The native engine: a plain model parallelized with PyTorch's own building blocks.

With pipeline parallelism the model is first cut into this rank's stages; each
part then gets, in TorchTitan's order, tensor parallelism, activation
checkpointing, compilation and FSDP2. AdamW (one per part) with warmup + cosine, gradient
accumulation over micro-batches (or pipeline micro-batches), global-norm clipping.
The loss is the `Loss` the engine is given.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from lmforge.engines.base import Engine, StepStats, warmup_cosine
from lmforge.engines.loss import Loss, LossInputs, Placement, cross_entropy
from lmforge.engines.loss_mask import learnt_per_rank, next_token_labels
from lmforge.engines.loss_scale import LossScale
from lmforge.models import Transformer, materialize
from lmforge.models.lora import apply_lora, is_nf4
from lmforge.parallel.checkpointing import apply_activation_checkpointing
from lmforge.parallel.compile import apply_compile
from lmforge.parallel.fsdp import apply_fsdp, gathered_across_forwards, needs_wrapping
from lmforge.parallel.mesh import ParallelDims
from lmforge.parallel.pipeline import (
    Stopwatch,
    TimedStage,
    build_schedule,
    cut_stage,
    split_layers,
    stage_indices,
    theoretical_bubble,
)
from lmforge.parallel.tensor import apply_tensor_parallel, replicate_beside_blocks

# Flattened optimizer state keys by parameter name: required with pipeline stages,
# used everywhere so a checkpoint loads under any layout.
STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def trainable(part: nn.Module) -> list[nn.Parameter]:
    """What the optimizer holds: everything, or with LoRA the adapters (and what trains beside the model)."""
    return [param for param in part.parameters() if param.requires_grad]


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


class NativeEngine(Engine):
    def __init__(self, spec, dims: ParallelDims, device: torch.device, loss: Loss):
        self.dims, self.device, self.spec, self.loss = dims, device, spec, loss
        self.tensor_parallel = dims.shape.tp > 1
        self.pipelined = dims.shape.pp > 1
        self.sharded = needs_wrapping(dims.shape, spec.train.precision, spec.parallel.cpu_offload)
        self.beside: dict[str, nn.Module] = {}
        loss.build(
            Placement(
                device,
                self._parallelize,
                tp_group=dims.tp_mesh.get_group() if self.tensor_parallel else None,
                pipelined=self.pipelined,
                grad_accum=spec.grad_accum,
            )
        )
        with torch.device("meta"):
            whole = Transformer(spec.model_arch)
        weights = spec.model.init_from
        parts = [materialize(part, device, spec.train.seed, weights) for part in self._cut(whole)]
        if spec.model.lora is not None:  # before the beside modules join: those train in full
            for part in parts:
                apply_lora(part, spec.model.lora, spec.train.seed)
        self.beside = loss.trainable_modules()
        for name, module in self.beside.items():
            setattr(parts[0], name, module)  # trained, sharded and checkpointed with the student (exports keep the model's own weights)
        self.parts = [self._parallelize(part) for part in parts]
        loss.bind(self.parts[0])
        opt = spec.optim
        self.optimizers = [
            torch.optim.AdamW(trainable(part), lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay, foreach=True)
            for part in self.parts
        ]
        factor = warmup_cosine(opt.warmup_steps, spec.decay_steps, opt.min_lr_ratio)
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in self.optimizers]
        self.grad_clip = opt.grad_clip
        self.scale = LossScale() if spec.train.precision == "fp16" else None
        if self.pipelined:
            self._build_pipeline()

    def _cut(self, whole: nn.Module) -> list[nn.Module]:
        if not self.pipelined:
            return [whole]
        p, shape = self.spec.parallel, self.dims.shape
        num_stages = shape.pp * p.virtual_stages
        ranges = split_layers(self.spec.model_arch, self.spec.train.seq_len, num_stages)
        self.stage_ids = stage_indices(self.dims.pp_rank, shape.pp, p.virtual_stages, p.schedule)
        self.num_stages = num_stages
        return [cut_stage(whole, ranges[i], first=i == 0, last=i == num_stages - 1) for i in self.stage_ids]

    def _parallelize(self, part: nn.Module) -> nn.Module:
        p = self.spec.parallel
        beside = tuple(module for name in self.beside if (module := getattr(part, name, None)) is not None)
        if self.tensor_parallel:
            apply_tensor_parallel(part, self.dims.tp_mesh, p.sequence_parallel)
            for module in beside:
                replicate_beside_blocks(module, self.dims.tp_mesh, p.sequence_parallel)
        apply_activation_checkpointing(part, p.activation_checkpointing, p.ac_every)
        if p.compile:
            apply_compile(part, self.tensor_parallel)
        if self.sharded:
            part = apply_fsdp(part, self.dims, p.zero, self.spec.train.precision, p.cpu_offload, units=beside)
        return part

    def _build_pipeline(self) -> None:
        self.compute = Stopwatch(self.device)
        stages = [
            TimedStage(part, index, self.num_stages, self.device, group=self.dims.pp_group, stopwatch=self.compute)
            for part, index in zip(self.parts, self.stage_ids)
        ]
        self.has_first = 0 in self.stage_ids
        self.has_last = self.num_stages - 1 in self.stage_ids
        p = self.spec.parallel
        self.schedule = build_schedule(stages, p.schedule, self.spec.grad_accum, self._timed_loss)
        self.bubble_theory = theoretical_bubble(p.schedule, self.dims.shape.pp, p.virtual_stages, self.spec.grad_accum)

    def _timed_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with self.compute.span():  # the schedule computes the loss outside the stage's chunk
            loss = self.loss.stage_loss(logits, target)
            return self.scale.scaled(loss) if self.scale else loss  # what the schedule's backward starts from

    def _labels(self, micro_batches: torch.Tensor, loss_mask) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(next tokens, IGNORE_INDEX where the loss mask is 0; N / dp for a masked batch,
        else None: every token counts and each micro-batch's mean serves)."""
        labels = next_token_labels(micro_batches, loss_mask)
        return labels, None if loss_mask is None else learnt_per_rank(labels, self.dims.dp_group, self.dims.shape.dp)

    def _loss_context(self):
        # With TP the logits are vocabulary-sharded DTensors: loss_parallel computes
        # the cross-entropy without gathering them.
        return loss_parallel() if self.tensor_parallel else nullcontext()

    def train_step(
        self,
        micro_batches: torch.Tensor,
        before_update: Callable[[], None] = lambda: None,
        loss_mask: Optional[torch.Tensor] = None,
        loss_inputs: LossInputs = None,
    ) -> StepStats:
        micro_batches = micro_batches.to(self.device, non_blocking=True)
        for part in self.parts:
            part.train()
        if self.loss.rewrites(loss_inputs):  # e.g. the student's continuations replace the data's (the spec refuses pipelines)
            with gathered_across_forwards(self.parts[0], self.spec.parallel.zero) if self.sharded else nullcontext():
                micro_batches, loss_mask = self.loss.rewrite(self.parts[0], micro_batches, loss_mask, loss_inputs)
        labels, learnt = self._labels(micro_batches, loss_mask)
        if self.pipelined:
            (loss, terms), bubble = self._pipeline_step(micro_batches, labels, learnt, loss_inputs)
        else:
            (loss, terms), bubble = self._accumulate(micro_batches, labels, learnt, loss_inputs), None
        lr = self.schedulers[0].get_last_lr()[0]
        scale = self.scale.scale if self.scale else None
        if self.scale:
            self.scale.unscale([p.grad for part in self.parts for p in part.parameters() if p.grad is not None])
        if terms:  # reduced with the loss: one collective
            reduced = torch.stack([loss, *terms.values()])
            if self.dims.shape.dp > 1:
                dist.all_reduce(reduced, op=dist.ReduceOp.AVG, group=self.dims.dp_group)
            loss, terms = reduced[0], dict(zip(terms, reduced[1:].tolist()))
        elif self.dims.shape.dp > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.dims.dp_group)
        grad_norm = self._clip_gradients()
        # Loss and norm are reduced over every rank, so all ranks decide alike.
        finite = bool(torch.isfinite(loss) and torch.isfinite(grad_norm))
        # fp16: gradients that overflowed while the loss did not are the scale's to handle.
        overflow = bool(self.scale and torch.isfinite(loss) and self.scale.update(grad_norm.item()))
        if finite:
            before_update()
        for optimizer, scheduler in zip(self.optimizers, self.schedulers):
            if finite:  # a non-finite step leaves weights, moments and the LR schedule as they were
                optimizer.step()
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        stats = StepStats(
            loss=loss.item(),
            grad_norm=grad_norm.item(),
            lr=lr,
            finite=finite,
            update_skipped=not finite,
            overflow=overflow,
            loss_scale=scale,
            terms=terms,
            next_loss_scale=self.scale.scale if self.scale else None,
        )
        if bubble is not None:
            stats.bubble, stats.bubble_theory = bubble, self.bubble_theory
        return stats

    def _accumulate(self, micro_batches: torch.Tensor, labels: torch.Tensor, learnt, loss_inputs: LossInputs) -> tuple[torch.Tensor, dict]:
        """The step's loss on this rank, and its terms."""
        model, accum = self.parts[0], micro_batches.shape[0]
        loss_sum = torch.zeros((), device=self.device)
        term_sums: dict[str, torch.Tensor] = {}
        for i, batch in enumerate(micro_batches):
            if self.sharded:
                model.set_requires_gradient_sync(i == accum - 1)
            with self._loss_context():
                loss, terms = self.loss(model, batch[:, :-1], labels[i], i, learnt, accum, loss_inputs)
                (self.scale.scaled(loss) if self.scale else loss).backward()
            loss_sum += _local(loss.detach())
            for name, value in terms.items():
                term_sums[name] = term_sums.get(name, 0) + value.detach()
        return loss_sum, term_sums

    def _pipeline_step(
        self, micro_batches: torch.Tensor, labels: torch.Tensor, learnt, loss_inputs: LossInputs
    ) -> tuple[tuple[torch.Tensor, dict], float]:
        """One schedule over this rank's micro-batches. Returns the mean loss and its
        terms (they live on the last stage; summed over the pipeline group so every rank
        reports them), and the bubble: the share of the schedule's time a rank spent
        not computing, averaged over the pipeline's ranks."""
        losses: list[torch.Tensor] = []
        self.loss.stage_begin(loss_inputs, self.device, learnt)
        self.compute.take()
        step_watch = Stopwatch(self.device)
        with self._loss_context(), step_watch.span():
            self.schedule.step(*self._stage_inputs(micro_batches), target=self._stage_target(labels), losses=losses)
        bubble = 1.0 - self.compute.take() / max(step_watch.take(), 1e-9)
        names = self.loss.term_names
        terms = self.loss.stage_totals(len(names), self.device)
        combined = torch.cat([torch.stack([self._last_stage_mean(losses), torch.tensor(bubble / self.dims.shape.pp, device=self.device)]), terms])
        dist.all_reduce(combined, group=self.dims.pp_group)
        return (combined[0], dict(zip(names, combined[2:]))), combined[1].item()

    def _stage_inputs(self, micro_batches: torch.Tensor) -> tuple:
        return (micro_batches.flatten(0, 1)[:, :-1],) if self.has_first else ()

    def _stage_target(self, labels: torch.Tensor):
        if not self.has_last:
            return None
        return self.loss.stage_target(labels.flatten(0, 1))

    def _last_stage_mean(self, losses: list[torch.Tensor]) -> torch.Tensor:
        if not self.has_last:
            return torch.zeros((), device=self.device)
        mean = torch.stack([_local(loss.detach()) for loss in losses]).mean()
        return mean / self.scale.scale if self.scale else mean  # the schedule kept the scaled losses

    @torch.no_grad()
    def eval_loss(self, micro_batches: torch.Tensor, loss_mask: Optional[torch.Tensor] = None) -> float:
        micro_batches = micro_batches.to(self.device, non_blocking=True)
        for part in self.parts:
            part.eval()
        labels, learnt = self._labels(micro_batches, loss_mask)
        with self._loss_context():
            if self.pipelined:
                losses: list[torch.Tensor] = []
                self.loss.stage_begin(None, self.device, learnt, held_out=True)
                self.schedule.eval(*self._stage_inputs(micro_batches), target=self._stage_target(labels), losses=losses)
                loss = self._last_stage_mean(losses)
                dist.all_reduce(loss, group=self.dims.pp_group)
            else:
                model = self.parts[0]
                if learnt is None:
                    loss = torch.stack([_local(cross_entropy(model(batch[:, :-1]), labels[i])) for i, batch in enumerate(micro_batches)]).mean()
                else:
                    loss = sum(_local(cross_entropy(model(batch[:, :-1]), labels[i], "sum")) for i, batch in enumerate(micro_batches)) / learnt
        if self.dims.shape.dp > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.dims.dp_group)
        return loss.item()

    @torch.no_grad()
    def evaluate(self, micro_batches: torch.Tensor, loss_mask: Optional[torch.Tensor] = None, loss_inputs: LossInputs = None) -> dict[str, float]:
        if not self.loss.measures_held_out:
            return super().evaluate(micro_batches, loss_mask=loss_mask)
        micro_batches = micro_batches.to(self.device, non_blocking=True)
        labels = next_token_labels(micro_batches, loss_mask)
        sums = self._held_out_pipelined(micro_batches, labels, loss_inputs) if self.pipelined else self._held_out(micro_batches, labels, loss_inputs)
        return self.loss.held_out_means(sums, self.dims.dp_group if self.dims.shape.dp > 1 else None)

    def _held_out(self, micro_batches: torch.Tensor, labels: torch.Tensor, loss_inputs: LossInputs) -> torch.Tensor:
        model = self.parts[0].eval()
        sums = torch.zeros(self.loss.held_out_size, device=self.device)
        with self._loss_context():
            for i, batch in enumerate(micro_batches):
                sums += self.loss.held_out_sums(model, batch[:, :-1], labels[i], i, loss_inputs)
        return sums

    def _held_out_pipelined(self, micro_batches: torch.Tensor, labels: torch.Tensor, loss_inputs: LossInputs) -> torch.Tensor:
        """The held-out sums from the last stage (the schedule's forward only), on every rank."""
        for part in self.parts:
            part.eval()
        self.loss.stage_begin(loss_inputs, self.device, None, held_out=True)
        with self._loss_context():
            self.schedule.eval(*self._stage_inputs(micro_batches), target=self._stage_target(labels))
        sums = self.loss.stage_totals(self.loss.held_out_size, self.device)
        dist.all_reduce(sums, group=self.dims.pp_group)
        return sums

    def _clip_gradients(self) -> torch.Tensor:
        params = [p for part in self.parts for p in part.parameters() if p.grad is not None]
        norm = _local(torch.nn.utils.get_total_norm([p.grad for p in params]))
        if self.pipelined:  # each rank holds other layers: combine squared norms
            norm = norm.pow(2)
            dist.all_reduce(norm, group=self.dims.pp_group)
            norm = norm.sqrt()
        if self.grad_clip:
            torch.nn.utils.clip_grads_with_norm_(params, self.grad_clip, norm)
        return norm

    def modules(self) -> list[torch.nn.Module]:
        return list(self.parts)

    def state_dict(self) -> tuple[dict, dict]:
        # Two nested dicts, not hundreds of top-level keys: DCP's async save does
        # per-key Python work while training waits. Checkpoint keys read "model.<fqn>"
        # and "optim.state.<fqn>.<moment>".
        model: dict = {}
        optim: dict = {}
        for part, optimizer in zip(self.parts, self.optimizers):
            # A QLoRA base's NF4 weights are left out: frozen, and made again from model.init_from.
            model.update({name: value for name, value in get_model_state_dict(part).items() if not is_nf4(value)})
            # Hyper-parameters come from the job, not the checkpoint: only tensors are saved.
            optim.update({k: v for k, v in get_optimizer_state_dict(part, optimizer, options=STATE_OPTIONS).items() if isinstance(v, torch.Tensor)})
        plain = {"scheduler": self.schedulers[0].state_dict()} | ({"loss_scale": self.scale.state_dict()} if self.scale else {})
        return {"model": model, "optim": optim}, plain

    def load_state_dict(self, tensors: dict, plain: dict) -> None:
        for part, optimizer, scheduler in zip(self.parts, self.optimizers, self.schedulers):
            saved = {name: tensors["model"][name] for name, value in get_model_state_dict(part).items() if not is_nf4(value)}
            set_model_state_dict(part, saved, options=StateDictOptions(strict=False))
            optim = get_optimizer_state_dict(part, optimizer, options=STATE_OPTIONS)
            optim.update({k: tensors["optim"][k] for k, v in optim.items() if isinstance(v, torch.Tensor)})
            set_optimizer_state_dict(part, optimizer, optim, options=STATE_OPTIONS)
            scheduler.load_state_dict(plain["scheduler"])
            for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = lr
        if self.scale and "loss_scale" in plain:  # a checkpoint of an fp16 run: its scale goes on
            self.scale.load_state_dict(plain["loss_scale"])

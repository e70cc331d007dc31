"""The native engine: a plain model parallelized with PyTorch's own building blocks.

With pipeline parallelism the model is first cut into this rank's stages; each
part then gets, in TorchTitan's order, tensor parallelism, activation
checkpointing, compilation and FSDP2. AdamW (one per part) with warmup + cosine, gradient
accumulation over micro-batches (or pipeline micro-batches), global-norm clipping.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
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

from lmforge.distill.hidden import ADAPTERS, BlockOutputs, HiddenAdapters
from lmforge.distill.objective import EVAL_METRICS, DistillObjective, compared_vocab
from lmforge.distill.pipelined import StagedObjective
from lmforge.distill.teacher import build_teacher, micro_batch, teacher_targets
from lmforge.engines.base import Engine, StepStats, warmup_cosine
from lmforge.models import Transformer, materialize
from lmforge.parallel.checkpointing import apply_activation_checkpointing
from lmforge.parallel.compile import apply_compile
from lmforge.parallel.fsdp import apply_fsdp, needs_wrapping
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


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


class NativeEngine(Engine):
    def __init__(self, spec, dims: ParallelDims, device: torch.device, vocab: Optional[int] = None):
        self.dims, self.device, self.spec = dims, device, spec
        self.tensor_parallel = dims.shape.tp > 1
        self.pipelined = dims.shape.pp > 1
        self.sharded = needs_wrapping(dims.shape, spec.train.precision)
        # The teacher first: its width sizes the student's hidden-state adapters. With an
        # offline cache there is none: its targets come with the batches.
        online = spec.distill is not None and spec.distill.cache is None
        self.teachers = [build_teacher(source.path, device, self._parallelize) for source in spec.distill.sources] if online else []
        with torch.device("meta"):
            whole = Transformer(spec.model_arch)
        weights = spec.model.init_from
        parts = [materialize(part, device, spec.train.seed, weights) for part in self._cut(whole)]
        hidden = spec.distill.hidden if spec.distill else None
        if hidden:
            self._attach_adapters(parts[0])
        self.parts = [self._parallelize(part) for part in parts]
        # Hooks go on the blocks as parallelized (an activation-checkpointing wrapper records once).
        self.hidden = (BlockOutputs(self.parts[0], hidden.layers), BlockOutputs(self.teachers[0], hidden.layers.values())) if hidden else None
        opt = spec.optim
        self.optimizers = [
            torch.optim.AdamW(part.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay, foreach=True)
            for part in self.parts
        ]
        factor = warmup_cosine(opt.warmup_steps, spec.decay_steps, opt.min_lr_ratio)
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in self.optimizers]
        self.grad_clip = opt.grad_clip
        self.objective = self.staged = None
        if spec.distill:
            self._build_objective(vocab)
        if self.pipelined:
            self._build_pipeline()

    def _attach_adapters(self, student: nn.Module) -> None:
        """Hidden-state adapters as a submodule of the student, so that they are trained,
        sharded and checkpointed with it (exports keep only the model's own weights)."""
        layers = self.spec.distill.hidden.layers
        adapters = HiddenAdapters(layers, self.spec.model_arch.dim, self.teachers[0].cfg.dim, seed=self.spec.train.seed)
        setattr(student, ADAPTERS, adapters.to(self.device))

    def _build_objective(self, vocab: Optional[int]) -> None:
        """The job's loss: cross-entropy, divergence from the teachers, hidden states."""
        train = self.spec.train
        self.objective = DistillObjective(self.spec, self.spec.grad_accum * train.micro_batch * train.seq_len, compared_vocab(self.spec, vocab, self.teachers),
                                          self.dims.tp_mesh.get_group() if self.tensor_parallel else None)
        if self.pipelined:  # from the cache: the last stage computes it, as the schedule's loss
            self.staged = StagedObjective(self.objective, self.spec.grad_accum)

    def _distill_loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, cached) -> tuple[torch.Tensor, dict]:
        logits, teacher = model(inputs), teacher_targets(self.teachers, inputs, cached, self.device)
        hidden = None
        if self.hidden is not None:
            student_side, teacher_side = self.hidden
            layers = self.spec.distill.hidden.layers
            adapted = list(getattr(model, ADAPTERS)(*student_side.take(layers)))
            hidden = (adapted, teacher_side.take(layers.values()))
        return self.objective(logits, targets, teacher, hidden)

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
        adapters = getattr(part, ADAPTERS, None)
        beside = (adapters,) if adapters is not None else ()
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

    def _timed_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.compute.span():  # the schedule computes the loss outside the stage's chunk
            return self._loss(logits, targets) if self.staged is None else self.staged(logits, targets)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def _loss_context(self):
        # With TP the logits are vocabulary-sharded DTensors: loss_parallel computes
        # the cross-entropy without gathering them.
        return loss_parallel() if self.tensor_parallel else nullcontext()

    def train_step(self, micro_batches: torch.Tensor, before_update: Callable[[], None] = lambda: None, targets=None) -> StepStats:
        micro_batches = micro_batches.to(self.device, non_blocking=True)
        for part in self.parts:
            part.train()
        (loss, terms), bubble = self._pipeline_step(micro_batches, targets) if self.pipelined else (self._accumulate(micro_batches, targets), None)
        lr = self.schedulers[0].get_last_lr()[0]
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
        if finite:
            before_update()
        for optimizer, scheduler in zip(self.optimizers, self.schedulers):
            if finite:  # a non-finite step leaves weights, moments and the LR schedule as they were
                optimizer.step()
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        stats = StepStats(loss=loss.item(), grad_norm=grad_norm.item(), lr=lr, finite=finite, update_skipped=not finite, terms=terms)
        if bubble is not None:
            stats.bubble, stats.bubble_theory = bubble, self.bubble_theory
        return stats

    def _accumulate(self, micro_batches: torch.Tensor, cached=None) -> tuple[torch.Tensor, dict]:
        """The step's loss on this rank, and its terms (a distillation job's)."""
        model, accum = self.parts[0], micro_batches.shape[0]
        loss_sum = torch.zeros((), device=self.device)
        term_sums: dict[str, torch.Tensor] = {}
        for i, batch in enumerate(micro_batches):
            if self.sharded:
                model.set_requires_gradient_sync(i == accum - 1)
            with self._loss_context():
                inputs, targets = batch[:, :-1], batch[:, 1:]
                if self.objective is None:
                    # Every sample has the same token count, so the mean of micro-batch means
                    # is the global-batch mean; FSDP averages over DP ranks.
                    loss, terms = self._loss(model(inputs), targets) / accum, {}
                else:
                    loss, terms = self._distill_loss(model, inputs, targets, micro_batch(cached, i))
                loss.backward()
            loss_sum += _local(loss.detach())
            for name, value in terms.items():
                term_sums[name] = term_sums.get(name, 0) + value.detach()
        return loss_sum, term_sums

    def _pipeline_step(self, micro_batches: torch.Tensor, cached=None) -> tuple[tuple[torch.Tensor, dict], float]:
        """One schedule over this rank's micro-batches. Returns the mean loss and a
        distillation's terms (they live on the last stage; summed over the pipeline group
        so every rank reports them), and the bubble: the share of the schedule's time a
        rank spent not computing, averaged over the pipeline's ranks."""
        losses: list[torch.Tensor] = []
        if self.staged is not None:
            self.staged.begin(cached, self.device)
        self.compute.take()
        step_watch = Stopwatch(self.device)
        with self._loss_context(), step_watch.span():
            self.schedule.step(*self._stage_inputs(micro_batches), target=self._stage_target(micro_batches), losses=losses)
        bubble = 1.0 - self.compute.take() / max(step_watch.take(), 1e-9)
        names = self.objective.term_names if self.staged is not None else []
        terms = self.staged.totals(len(names), self.device) if names else torch.zeros(0, device=self.device)
        combined = torch.cat([torch.stack([self._last_stage_mean(losses), torch.tensor(bubble / self.dims.shape.pp, device=self.device)]), terms])
        dist.all_reduce(combined, group=self.dims.pp_group)
        return (combined[0], dict(zip(names, combined[2:]))), combined[1].item()

    def _stage_inputs(self, micro_batches: torch.Tensor) -> tuple:
        return (micro_batches.flatten(0, 1)[:, :-1],) if self.has_first else ()

    def _stage_target(self, micro_batches: torch.Tensor):
        if not self.has_last:
            return None
        tokens = micro_batches.flatten(0, 1)[:, 1:]
        return tokens if self.staged is None else self.staged.target(tokens)

    def _last_stage_mean(self, losses: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([_local(l.detach()) for l in losses]).mean() if self.has_last else torch.zeros((), device=self.device)

    @torch.no_grad()
    def eval_loss(self, micro_batches: torch.Tensor) -> float:
        micro_batches = micro_batches.to(self.device, non_blocking=True)
        for part in self.parts:
            part.eval()
        with self._loss_context():
            if self.pipelined:
                losses: list[torch.Tensor] = []
                self.schedule.eval(*self._stage_inputs(micro_batches), target=self._stage_target(micro_batches), losses=losses)
                loss = self._last_stage_mean(losses)
                dist.all_reduce(loss, group=self.dims.pp_group)
            else:
                model = self.parts[0]
                loss = torch.stack([_local(self._loss(model(batch[:, :-1]), batch[:, 1:])) for batch in micro_batches]).mean()
        if self.dims.shape.dp > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.dims.dp_group)
        return loss.item()

    @torch.no_grad()
    def evaluate(self, micro_batches: torch.Tensor, targets=None) -> dict[str, float]:
        if self.objective is None:
            return super().evaluate(micro_batches)
        micro_batches = micro_batches.to(self.device, non_blocking=True)
        sums = self._held_out_pipelined(micro_batches, targets) if self.pipelined else self._held_out(micro_batches, targets)
        return self.objective.held_out_means(sums, micro_batches[..., 1:].numel(), self.dims.dp_group if self.dims.shape.dp > 1 else None)

    def _held_out(self, micro_batches: torch.Tensor, targets) -> torch.Tensor:
        model = self.parts[0].eval()
        sums = torch.zeros(len(EVAL_METRICS), device=self.device)
        with self._loss_context():
            for i, batch in enumerate(micro_batches):
                teacher = teacher_targets(self.teachers, batch[:, :-1], micro_batch(targets, i), self.device)
                sums += self.objective.held_out_sums(model(batch[:, :-1]), batch[:, 1:], teacher)
                for side in self.hidden or ():
                    side.clear()
        return sums

    def _held_out_pipelined(self, micro_batches: torch.Tensor, targets) -> torch.Tensor:
        """The held-out sums from the last stage (the schedule's forward only), on every rank."""
        for part in self.parts:
            part.eval()
        self.staged.begin(targets, self.device, held_out=True)
        with self._loss_context():
            self.schedule.eval(*self._stage_inputs(micro_batches), target=self._stage_target(micro_batches))
        sums = self.staged.totals(len(EVAL_METRICS), self.device)
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
            model.update(get_model_state_dict(part))
            # Hyper-parameters come from the job, not the checkpoint: only tensors are saved.
            optim.update({k: v for k, v in get_optimizer_state_dict(part, optimizer, options=STATE_OPTIONS).items() if isinstance(v, torch.Tensor)})
        return {"model": model, "optim": optim}, {"scheduler": self.schedulers[0].state_dict()}

    def load_state_dict(self, tensors: dict, plain: dict) -> None:
        for part, optimizer, scheduler in zip(self.parts, self.optimizers, self.schedulers):
            model_sd = get_model_state_dict(part)
            set_model_state_dict(part, {k: tensors["model"][k] for k in model_sd})
            optim = get_optimizer_state_dict(part, optimizer, options=STATE_OPTIONS)
            optim.update({k: tensors["optim"][k] for k, v in optim.items() if isinstance(v, torch.Tensor)})
            set_optimizer_state_dict(part, optimizer, optim, options=STATE_OPTIONS)
            scheduler.load_state_dict(plain["scheduler"])
            for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = lr

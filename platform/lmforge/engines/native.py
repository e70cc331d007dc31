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
from lmforge.distill.objective import HELD_OUT_SUMS, DistillObjective, compared_vocab
from lmforge.distill.on_policy import Rollout
from lmforge.distill.pipelined import StagedObjective
from lmforge.distill.teacher import build_teacher, micro_batch, teacher_targets
from lmforge.engines.base import Engine, StepStats, warmup_cosine
from lmforge.engines.loss_mask import learnt_per_rank, next_token_labels
from lmforge.models import Transformer, materialize
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
        online = spec.distill is not None and spec.distill.online
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
        self.learnt: Optional[torch.Tensor] = None  # a masked step's N / dp, for the pipeline schedule's loss
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

    def _distill_loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, cached, learnt, on_policy: bool) -> tuple[torch.Tensor, dict]:
        logits, teacher = model(inputs), teacher_targets(self.teachers, inputs, cached, self.device)
        hidden = None
        if self.hidden is not None:
            student_side, teacher_side = self.hidden
            layers = self.spec.distill.hidden.layers
            adapted = list(getattr(model, ADAPTERS)(*student_side.take(layers)))
            hidden = (adapted, teacher_side.take(layers.values()))
        return self.objective(logits, targets, teacher, hidden, learnt, on_policy)

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
            if self.staged is not None:
                return self.staged(logits, targets)
            if self.learnt is None:
                return self._loss(logits, targets)
            # The schedule averages its micro-batches' losses: each one's sum over N/dp, times their count.
            return self._loss_sum(logits, targets) / self.learnt * self.spec.grad_accum

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def _loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Over the learnt tokens (IGNORE_INDEX labels add nothing)."""
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")

    def _labels(self, micro_batches: torch.Tensor, loss_mask) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(next tokens, IGNORE_INDEX where the loss mask is 0; N / dp for a masked batch,
        else None: every token counts and each micro-batch's mean serves)."""
        labels = next_token_labels(micro_batches, loss_mask)
        return labels, None if loss_mask is None else learnt_per_rank(labels, self.dims.dp_group, self.dims.shape.dp)

    def _loss_context(self):
        # With TP the logits are vocabulary-sharded DTensors: loss_parallel computes
        # the cross-entropy without gathering them.
        return loss_parallel() if self.tensor_parallel else nullcontext()

    def train_step(self, micro_batches: torch.Tensor, before_update: Callable[[], None] = lambda: None, targets=None,
                   loss_mask: Optional[torch.Tensor] = None, on_policy: Optional[Rollout] = None) -> StepStats:
        micro_batches = micro_batches.to(self.device, non_blocking=True)
        for part in self.parts:
            part.train()
        if on_policy is not None:  # the student's continuations replace the data's (the spec refuses pipelines)
            with gathered_across_forwards(self.parts[0], self.spec.parallel.zero) if self.sharded else nullcontext():
                micro_batches, loss_mask = on_policy.continue_prompts(self.parts[0], micro_batches, loss_mask, self.objective.vocab,
                                                                      self.objective.tp_group)
            targets = None  # the teachers score the new tokens online
        labels, learnt = self._labels(micro_batches, loss_mask)
        if self.pipelined:
            (loss, terms), bubble = self._pipeline_step(micro_batches, labels, learnt, targets)
        else:
            (loss, terms), bubble = self._accumulate(micro_batches, labels, learnt, targets, on_policy is not None), None
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

    def _accumulate(self, micro_batches: torch.Tensor, labels: torch.Tensor, learnt, cached=None, on_policy: bool = False) -> tuple[torch.Tensor, dict]:
        """The step's loss on this rank, and its terms (a distillation job's)."""
        model, accum = self.parts[0], micro_batches.shape[0]
        loss_sum = torch.zeros((), device=self.device)
        term_sums: dict[str, torch.Tensor] = {}
        for i, batch in enumerate(micro_batches):
            if self.sharded:
                model.set_requires_gradient_sync(i == accum - 1)
            with self._loss_context():
                inputs, targets = batch[:, :-1], labels[i]
                if self.objective is None:
                    # Every sample has the same token count, so the mean of micro-batch means
                    # is the global-batch mean; FSDP averages over DP ranks. A masked batch's
                    # micro-batches hold different counts: each one's sum over N / dp.
                    loss = self._loss(model(inputs), targets) / accum if learnt is None else self._loss_sum(model(inputs), targets) / learnt
                    terms = {}
                else:
                    loss, terms = self._distill_loss(model, inputs, targets, micro_batch(cached, i), learnt, on_policy)
                loss.backward()
            loss_sum += _local(loss.detach())
            for name, value in terms.items():
                term_sums[name] = term_sums.get(name, 0) + value.detach()
        return loss_sum, term_sums

    def _pipeline_step(self, micro_batches: torch.Tensor, labels: torch.Tensor, learnt, cached=None) -> tuple[tuple[torch.Tensor, dict], float]:
        """One schedule over this rank's micro-batches. Returns the mean loss and a
        distillation's terms (they live on the last stage; summed over the pipeline group
        so every rank reports them), and the bubble: the share of the schedule's time a
        rank spent not computing, averaged over the pipeline's ranks."""
        losses: list[torch.Tensor] = []
        self.learnt = learnt
        if self.staged is not None:
            self.staged.begin(cached, self.device, learnt=learnt)
        self.compute.take()
        step_watch = Stopwatch(self.device)
        with self._loss_context(), step_watch.span():
            self.schedule.step(*self._stage_inputs(micro_batches), target=self._stage_target(labels), losses=losses)
        bubble = 1.0 - self.compute.take() / max(step_watch.take(), 1e-9)
        names = self.objective.term_names if self.staged is not None else []
        terms = self.staged.totals(len(names), self.device) if names else torch.zeros(0, device=self.device)
        combined = torch.cat([torch.stack([self._last_stage_mean(losses), torch.tensor(bubble / self.dims.shape.pp, device=self.device)]), terms])
        dist.all_reduce(combined, group=self.dims.pp_group)
        return (combined[0], dict(zip(names, combined[2:]))), combined[1].item()

    def _stage_inputs(self, micro_batches: torch.Tensor) -> tuple:
        return (micro_batches.flatten(0, 1)[:, :-1],) if self.has_first else ()

    def _stage_target(self, labels: torch.Tensor):
        if not self.has_last:
            return None
        tokens = labels.flatten(0, 1)
        return tokens if self.staged is None else self.staged.target(tokens)

    def _last_stage_mean(self, losses: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([_local(l.detach()) for l in losses]).mean() if self.has_last else torch.zeros((), device=self.device)

    @torch.no_grad()
    def eval_loss(self, micro_batches: torch.Tensor, loss_mask: Optional[torch.Tensor] = None) -> float:
        micro_batches = micro_batches.to(self.device, non_blocking=True)
        for part in self.parts:
            part.eval()
        labels, self.learnt = self._labels(micro_batches, loss_mask)
        with self._loss_context():
            if self.pipelined:
                losses: list[torch.Tensor] = []
                self.schedule.eval(*self._stage_inputs(micro_batches), target=self._stage_target(labels), losses=losses)
                loss = self._last_stage_mean(losses)
                dist.all_reduce(loss, group=self.dims.pp_group)
            else:
                model = self.parts[0]
                if self.learnt is None:
                    loss = torch.stack([_local(self._loss(model(batch[:, :-1]), labels[i])) for i, batch in enumerate(micro_batches)]).mean()
                else:
                    loss = sum(_local(self._loss_sum(model(batch[:, :-1]), labels[i])) for i, batch in enumerate(micro_batches)) / self.learnt
        if self.dims.shape.dp > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.dims.dp_group)
        return loss.item()

    @torch.no_grad()
    def evaluate(self, micro_batches: torch.Tensor, targets=None, loss_mask: Optional[torch.Tensor] = None) -> dict[str, float]:
        if self.objective is None:
            return super().evaluate(micro_batches, loss_mask=loss_mask)
        micro_batches = micro_batches.to(self.device, non_blocking=True)
        labels = next_token_labels(micro_batches, loss_mask)
        sums = self._held_out_pipelined(micro_batches, labels, targets) if self.pipelined else self._held_out(micro_batches, labels, targets)
        return self.objective.held_out_means(sums, self.dims.dp_group if self.dims.shape.dp > 1 else None)

    def _held_out(self, micro_batches: torch.Tensor, labels: torch.Tensor, targets) -> torch.Tensor:
        model = self.parts[0].eval()
        sums = torch.zeros(HELD_OUT_SUMS, device=self.device)
        with self._loss_context():
            for i, batch in enumerate(micro_batches):
                teacher = teacher_targets(self.teachers, batch[:, :-1], micro_batch(targets, i), self.device)
                sums += self.objective.held_out_sums(model(batch[:, :-1]), labels[i], teacher)
                for side in self.hidden or ():
                    side.clear()
        return sums

    def _held_out_pipelined(self, micro_batches: torch.Tensor, labels: torch.Tensor, targets) -> torch.Tensor:
        """The held-out sums from the last stage (the schedule's forward only), on every rank."""
        for part in self.parts:
            part.eval()
        self.staged.begin(targets, self.device, held_out=True)
        with self._loss_context():
            self.schedule.eval(*self._stage_inputs(micro_batches), target=self._stage_target(labels))
        sums = self.staged.totals(HELD_OUT_SUMS, self.device)
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

"""The per-rank training loop: mesh -> engine -> restore -> feed -> steps -> evaluations -> checkpoints.

Runs inside a worker actor (or any process with torch.distributed initialized)
and reports each step's metrics through a callback; it knows nothing of Ray's
actors, so it can be driven by a benchmark or a test directly.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from lmforge.checkpoint.memory import SnapshotTarget, SnapshotWriter, load_snapshot, snapshot_state
from lmforge.checkpoint.schedule import CheckpointSchedule
from lmforge.checkpoint.sharded import load_checkpoint, restore_point
from lmforge.checkpoint.state import MlflowRef, TrainerState
from lmforge.checkpoint.store import CheckpointStore
from lmforge.checkpoint.writer import CheckpointWriter
from lmforge.credentials import without_credentials
from lmforge.data.feed import BatchFeed, FedStep, datasets_of
from lmforge.data.heldout import HeldOutBatches, eval_batches
from lmforge.data.identity import order_inputs
from lmforge.data.manifest import DatasetManifest, Manifest, tokenizer_location
from lmforge.data.order import BatchLayout
from lmforge.distill.cache_manifest import teacher_cache
from lmforge.distill.loss import DistillLoss
from lmforge.distill.served_teacher import served_scorer
from lmforge.engines import CrossEntropy, Loss, create_engine
from lmforge.errors import OutOfMemory
from lmforge.events import BatchSkipped, Eval, Event, RankResult, Restored, Start, Step
from lmforge.guards.divergence import DivergenceGuard
from lmforge.guards.inject import FaultInjector
from lmforge.guards.leaks import LeakCheck
from lmforge.guards.memory_report import memory_report
from lmforge.guards.stragglers import StragglerWatch
from lmforge.parallel.mesh import build_mesh
from lmforge.parallel.shape import MeshShape
from lmforge.planner.fit import check_fits
from lmforge.spec import JobSpec
from lmforge.tracking.flops import mfu, peak_flops

Reporter = Callable[[Event], None]


class Trainer:
    def __init__(
        self,
        spec: JobSpec,
        manifest: Manifest,
        report: Optional[Reporter] = None,
        should_stop: Optional[Callable[[], bool]] = None,
        metrics=None,
        reader=None,
        snapshot_target: Optional[SnapshotTarget] = None,
        snapshot_source=None,
    ):
        """`reader`: the job's shared `FeedReader` (its controller's); else this rank starts its own.
        `snapshot_target`: where `checkpoint.in_memory` snapshots go; `snapshot_source`
        (`step`, `fetch(name)`): the newest complete one, restored instead of storage's
        latest checkpoint when it is at least as new."""
        self.spec, self.manifest = spec, manifest
        self.report = report or (lambda event: None)
        # What the run directory records since the last checkpoint: that checkpoint
        # carries it, for a driver killed before these lines reached metrics.jsonl.
        self.unsaved_records: list[dict] = []
        self.metrics = metrics  # this rank's exported gauges (`lmforge.tracking.prometheus.RankMetrics`), under Ray
        self.should_stop = should_stop  # asked on rank 0 after each checkpoint (elastic growth)
        self.rank = dist.get_rank()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        p = spec.parallel
        self.dims = build_mesh(self.device.type, MeshShape.for_spec(p))
        torch.manual_seed(spec.train.seed + self.rank)
        self.store = CheckpointStore(spec.checkpoint_dir)
        # Checkpoint I/O gets its own gloo group: its background collectives must not
        # interleave with training's (and DCP's async save needs a CPU backend).
        checkpoint_group = dist.new_group(backend="gloo")
        # Always from the job's own checkpoints: the driver started a `resume: false` job
        # on a directory holding none, so whatever is there now this job wrote (a restart).
        from_memory = self._newer_in_memory(snapshot_source, checkpoint_group)
        memory_state = snapshot_state(snapshot_source.fetch) if from_memory else None
        resume_from = restore_point(self.store, checkpoint_group, self._event) if not from_memory else None
        self.start_step = (memory_state.step or 0) if from_memory else resume_from.step if resume_from else 0
        if self.rank == 0:
            self.store.clear_after(self.start_step)  # corrupt (set aside) or half-written: to be written again
        dist.barrier(group=checkpoint_group)
        self.writer = CheckpointWriter(self.store, spec.checkpoint, checkpoint_group, self._event)
        # The clock's word travels in a group of its own: the writer's may be busy in its thread.
        clock_group = dist.new_group(backend="gloo") if spec.checkpoint.every_minutes else None
        self.schedule = CheckpointSchedule(spec.checkpoint, spec.train.max_steps, lambda flag: _rank0_says(flag, clock_group))
        # Snapshots get a group of their own too: one may be in flight beside a checkpoint.
        self.snapshots = SnapshotWriter(snapshot_target, dist.new_group(backend="gloo")) if snapshot_target else None
        world = dist.get_world_size()
        self.stragglers = StragglerWatch(dist.new_group(backend="gloo") if world > 1 else None, world)
        # Start reading ahead first: Ray Data's first read overlaps model building.
        self.layout = BatchLayout(spec.train.global_batch, spec.train.micro_batch, p.dp)
        self.cache = teacher_cache(spec)  # a distillation's offline top-k targets (an instruction dataset's own)
        scorer = served_scorer(spec.distill)  # or a served teacher's, asked as the rows are read
        datasets, self.mixture = datasets_of(spec, manifest)
        self.feed = BatchFeed(
            datasets,
            self.mixture,
            self.layout,
            dp_rank=self.dims.dp_rank,
            start_step=self.start_step,
            prefetch_steps=spec.data.prefetch_steps,
            cache=self.cache,
            reader=reader,
            end_step=spec.train.max_steps,
            scorer=scorer,
        )
        if self.device.type == "cuda" and not spec.resources.memory_per_worker:
            check_fits(spec, torch.cuda.get_device_properties(self.device).total_memory, f"{torch.cuda.get_device_name(self.device)} memory")
        self.loss = job_loss(spec, manifest.tokenizer.vocab_size, manifest.tokenizer.eos_id, tokenizer_location(spec.data.path, manifest))
        self.engine = create_engine(spec, self.dims, self.device, self.loss)
        self.held_out = None
        if spec.eval is not None and isinstance(manifest, DatasetManifest):  # a mixture has no held-out split (spec rules)
            self.held_out = HeldOutBatches(spec.data.path, manifest, self.layout, self.dims.dp_rank, eval_batches(spec, manifest), self.cache, scorer)
        self.peak_flops = peak_flops(self.device, spec.train.precision)
        self.flops_per_step = spec.model_arch.flops_per_token(spec.train.seq_len) * spec.train.global_batch * spec.train.seq_len
        if from_memory:
            load_snapshot(snapshot_source.fetch, self.engine, memory_state)
            self._event(Restored(step=self.start_step, path="memory", from_memory=True))
        elif resume_from is not None:
            load_checkpoint(self.store, resume_from, self.engine)
            self._event(Restored(step=resume_from.step, path=resume_from.path, from_memory=False))
        self.skip_batches = set(spec.guards.skip_batches)
        self.divergence = DivergenceGuard(spec.guards)
        self.leaks = LeakCheck() if spec.guards.leak_check else None
        self.faults = FaultInjector(spec, self.engine, self.rank)
        self._event(Start(step=self.start_step))

    def _newer_in_memory(self, source, group: dist.ProcessGroup) -> bool:
        """Rank 0 decides for all: is the snapshot at least as new as storage's latest
        committed checkpoint? (Storage is not read otherwise, so a lost or slow store
        does not hold a restore up.)"""
        decision = [source is not None and self.rank == 0 and source.step >= max(self.store.committed(), default=0)]
        dist.broadcast_object_list(decision, src=0, group=group)
        return bool(decision[0])

    def _event(self, event: Event) -> None:
        if self.rank == 0:
            self.report(event)
            if isinstance(event, (Step, Eval)):
                self.unsaved_records.append(event.as_dict())

    def _trainer_state(self, step: int) -> TrainerState:
        run_id = self.spec.tracking.run_id
        return TrainerState(
            step=step,
            samples_consumed=step * self.spec.train.global_batch,
            global_batch=self.spec.train.global_batch,
            seed=self.spec.train.seed,
            dp=self.spec.parallel.dp,
            model=self.spec.model_arch.as_dict(),
            lora=self.spec.model.lora,
            init_from=self.spec.model.init_from,
            data_path=self.spec.data.path or self.spec.data.paths[0],
            order=order_inputs(self.spec, self.manifest),
            job=self.spec.name,
            mlflow=MlflowRef(tracking_uri=without_credentials(self.spec.tracking_uri), run_id=run_id) if run_id else None,
        )

    def run(self) -> RankResult:
        train = self.spec.train
        step = self.start_step
        last = None
        stopped = False
        self.stragglers.begin()
        try:
            while step < train.max_steps:
                began = time.perf_counter()
                fed = self.feed.next()
                assert fed.step == step
                step += 1
                if step in self.skip_batches:
                    self._event(BatchSkipped(step=step))
                else:
                    last = self._train_step(step, fed, began) or last
                if self.held_out and (step % self.spec.eval_interval == 0 or step == train.max_steps):
                    self._evaluate(step)
                # Also at a checkpoint's step: until that checkpoint commits, the snapshot is the step's only copy.
                if self.snapshots and step % self.spec.checkpoint.memory_interval == 0 and step < train.max_steps:
                    self.snapshots.save(step, self.engine, self._trainer_state(step))
                if self.schedule.due(step):
                    self.writer.save(step, self.engine, self._trainer_state(step).model_copy(update={"records": self.unsaved_records}))
                    self.unsaved_records = []
                    if step < train.max_steps and self._stop_requested():
                        stopped = True
                        break
            if self.snapshots:
                self.snapshots.close()
            self.writer.close()  # the last checkpoint is committed before the run counts as done
        finally:
            self.feed.close()
        return RankResult(step=step, loss=last.loss if last else None, start_step=self.start_step, stopped=stopped)

    def settle(self, timeout_s: float) -> None:
        """After a failure: let the checkpoint and snapshot being written finish (they
        commit, and their threads let go of the engine), within `timeout_s` in all."""
        deadline = time.monotonic() + timeout_s
        for saver in (self.writer, self.snapshots):
            if saver is not None:
                saver.settle(max(0.0, deadline - time.monotonic()))

    def _train_step(self, step: int, fed: FedStep, began: float) -> Step | None:
        """One optimizer step; its metrics (None when the step was not finite)."""
        train = self.spec.train
        try:
            self.faults.before_step(step)
            loss_inputs = self.loss.step_inputs(step, fed.ids, fed.targets)
            # A checkpoint started at the last step may still be copying the weights.
            self.stragglers.ready()
            stats = self.engine.train_step(
                torch.from_numpy(fed.tokens.astype(np.int64)), before_update=self._staged, loss_mask=_mask(fed.loss_mask), loss_inputs=loss_inputs
            )
        except torch.OutOfMemoryError as err:
            raise OutOfMemory(step, self.rank, train.micro_batch, memory_report(self.spec, self.rank, step, self.device, err)) from None
        stragglers = self.stragglers.done()
        self.faults.after_step()
        elapsed = time.perf_counter() - began
        tokens_per_step = train.global_batch * train.seq_len
        for event in self.divergence.observe(step, stats):  # raises Diverged at the limit
            self._event(event)
        for event in self.leaks.after_step(step) if self.leaks else ():
            self._event(event)
        if not stats.finite:
            return None
        optional: dict = {}
        if self.mixture is not None:  # the realised mixture: samples of each source in this step
            optional["mixture"] = self.mixture.taken((step - 1) * train.global_batch, train.global_batch).tolist()
        if self.spec.data.record_sample_ids:
            optional["sample_ids"] = self._global_ids(fed.ids)
        if stats.bubble is not None:
            optional.update(bubble=stats.bubble, bubble_theory=stats.bubble_theory)
        if stats.loss_scale is not None:
            optional["loss_scale"] = stats.loss_scale
        row = Step(
            step=step,
            loss=stats.loss,
            lr=stats.lr,
            grad_norm=stats.grad_norm,
            step_time=elapsed,
            data_wait=fed.waited,
            tokens_per_s=tokens_per_step / elapsed,
            mfu=mfu(self.flops_per_step, elapsed, self.peak_flops, dist.get_world_size()),
            tokens=step * tokens_per_step,
            samples_consumed=step * train.global_batch,
            **optional,
            **stragglers,
            **stats.terms,  # the loss's named terms, and what it adds of its own
            **self.loss.row_fields(loss_inputs),
        )
        if self.metrics:
            self.metrics.step(row, torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else None)
        self._event(row)
        return row

    def _staged(self) -> None:
        """The state a checkpoint or snapshot is copying is copied: it may change now."""
        self.writer.staged()
        if self.snapshots:
            self.snapshots.staged()

    def _evaluate(self, step: int) -> None:
        """The held-out loss (and a distillation's agreement with the teacher): every
        layout reads the same samples, so each is one number."""
        began = time.perf_counter()
        batches = [
            self.engine.evaluate(torch.from_numpy(tokens.astype(np.int64)), loss_mask=_mask(mask), loss_inputs=self.loss.held_out_inputs(targets))
            for tokens, targets, mask in self.held_out
        ]
        metrics = {name: float(np.mean([b[name] for b in batches])) for name in batches[0]}
        self._event(
            Eval(
                step=step,
                **metrics,
                eval_ppl=math.exp(min(metrics["eval_loss"], 700.0)),
                batches=len(batches),
                seconds=round(time.perf_counter() - began, 3),
            )
        )

    def _stop_requested(self) -> bool:
        """Rank 0 asks; every rank gets the same answer."""
        if self.should_stop is None:
            return False
        flag = torch.tensor([int(self.rank == 0 and self.should_stop())], device=self.device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def _global_ids(self, ids: np.ndarray) -> list[int]:
        """The whole global batch's sample ids, as the DP ranks actually read them."""
        local = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).to(self.device)
        if self.dims.shape.dp == 1:
            return local.tolist()
        gathered = [torch.empty_like(local) for _ in range(self.dims.shape.dp)]
        dist.all_gather(gathered, local, group=self.dims.dp_group)
        return torch.cat(gathered).cpu().tolist()


def _rank0_says(flag: bool, group: Optional[dist.ProcessGroup]) -> bool:
    """Rank 0's flag, on every rank of `group` (the whole job)."""
    value = torch.tensor([int(flag)], dtype=torch.int32)
    dist.broadcast(value, src=0, group=group)
    return bool(value.item())


def _mask(loss_mask):
    return None if loss_mask is None else torch.from_numpy(loss_mask.astype(bool))


def job_loss(spec: JobSpec, vocab: Optional[int] = None, eos: int = 0, tokenizer: Optional[str] = None) -> Loss:
    """What the job minimises: a distillation's loss, or cross-entropy. `vocab`: the
    tokenizer's real vocabulary; `eos`: its end-of-text id (on-policy rollouts end there);
    `tokenizer`: its tokenizer.json (teachers of another tokenizer read the text through it)."""
    return DistillLoss(spec, vocab, eos, tokenizer) if spec.distill else CrossEntropy()

"""The Controller actor: starts one Worker per rank in the slots that `Capacity`
holds, hands out the rendezvous, runs the group and relays rank 0's events to the driver.

A failing rank (it raises, its actor or its node dies) ends the attempt: the ranks
that are done with it and answer are kept for the next one (re-ranked, torch and
the model code loaded), the others killed so none stays blocked in a collective. Within `fault_tolerance.max_failures`
the controller then starts again from the latest committed checkpoint, after a
backoff: in the slots on live nodes (spare slots take lost ones' place), or, with
`elastic`, on the largest data-parallel size they hold. A job that shrank looks for room to grow back;
when there is, its ranks stop at their next checkpoint and it restarts larger.
Bad input and a checkpoint directory that keeps refusing writes are not retried.
Numerical and memory trouble is not a failure: non-finite steps roll back to the
latest checkpoint skipping their batches, and out-of-memory restarts from it with
a smaller micro-batch (both in `lmforge.guards`).
"""

from __future__ import annotations

import threading
import time

import ray

from lmforge.checkpoint.store import CheckpointStore
from lmforge.cluster import placement
from lmforge.cluster.capacity import Capacity
from lmforge.cluster.hang import RankHung, diagnose
from lmforge.cluster.keepers import Keepers
from lmforge.cluster.supervision import FailureBudget, Handoff
from lmforge.cluster.worker import RankAddress, Worker
from lmforge.data.feed import datasets_of, first_chunks, start_reader
from lmforge.data.manifest import Manifest
from lmforge.data.order import BatchLayout
from lmforge.distill.cache_manifest import teacher_cache
from lmforge.distill.served_teacher import served_scorer
from lmforge.errors import CheckpointWritesFailing, Diverged, OutOfMemory, TrainingFailed, UserError, first_line
from lmforge.events import Event, Failure, InOrder, JobResult, Layout, OutOfMemoryEvent, Reader, Recovered, Resized, Rollback, Start, Step
from lmforge.guards.oom import with_smaller_micro_batch
from lmforge.parallel.shape import MeshShape
from lmforge.spec import JobSpec
from lmforge.tracking.prometheus import JobMetrics

READER_ANSWER_S = 5.0  # a kept reader must answer its new layout within this, or a new one starts
LEAVE_S = 2.0  # a rank must be done with a failed attempt, and leave its groups, within this to be kept


@ray.remote(num_cpus=0, max_concurrency=8)
class Controller:
    def __init__(self, spec_dict: dict, manifest: Manifest, placement_timeout_s: float = 120.0, handoff: Handoff | None = None):
        """`handoff`: this controller replaces one that died; it continues the failure
        and rollback counts and reports the recovery. `spec_dict` is then the job as
        the guards left it."""
        self.spec_dict, self.manifest = spec_dict, manifest
        self.placement_timeout_s = placement_timeout_s
        self._events: list[Event] = []
        self._metrics = JobMetrics(spec_dict["name"])
        self._lock = threading.Lock()
        self._workers: list = []
        self._worker_slots: list = []  # each worker's placement group
        self._train_refs: list = []
        self._idle: list[tuple] = []  # (worker, placement group) kept from the last attempt
        self._standby: list[tuple] = []  # (worker, placement group) started ahead in spare slots
        self._reader = None  # the job's shared data reader, kept across attempts while its node lives
        self._reader_node = ""
        self._bytes_read = 0  # by the readers replaced since
        self._capacity: Capacity | None = None  # created by run()
        self._keepers = Keepers() if spec_dict.get("checkpoint", {}).get("in_memory") else None  # in-memory snapshots
        self._rank_nodes: list[str] = []
        self._rank_pids: list[int] = []
        self._layout: list[dict] = []
        self._failed_layout: list[dict] = []
        self._dp = 0
        self._attempt = 0
        self._in_order = InOrder()  # the attempt's rank reports, in the rank's order
        self._last_step = 0
        self._failed_rank: int | None = None
        self._raised_at: float | None = None
        self._failed_at: float | None = None  # set from a failure until the first step after it
        self._progress_at: float | None = None  # when this attempt last reported a step
        self._redone = 0
        self._resize_from: tuple[int, float] | None = None  # (dp, when) of a planned resize
        self._failures = 0
        self._rollbacks = 0
        self._replacement = handoff is not None
        if handoff:
            self._failures = self._attempt = handoff.failures
            self._rollbacks = handoff.rollbacks
            self._last_step, self._failed_at = handoff.step, handoff.failed_at

    def drain(self) -> list[Event]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def report(self, event: Event, attempt: int | None = None, number: int | None = None) -> None:
        """`number`: the rank's count of its reports this attempt. This actor's threads
        may run a rank's calls out of order; they are recorded in the rank's order."""
        with self._lock:
            if attempt is not None and attempt != self._attempt:
                return
            for ready in [event] if number is None else self._in_order.arrived(number, event):
                self._record(ready)

    def _record(self, event: Event) -> None:
        """One report, in order (the lock held)."""
        before = len(self._events)
        if isinstance(event, Step) and self._failed_at is not None:
            self._events.append(
                Recovered(
                    step=event.step,
                    dp=self._dp,
                    seconds=round(time.time() - self._failed_at, 2),
                    steps_redone=self._redone,
                    nodes_lost=self._nodes_lost(self._failed_layout),
                    time=time.time(),
                )
            )
            self._failed_at = None
        if isinstance(event, Step) and self._resize_from is not None:
            from_dp, since = self._resize_from
            self._events.append(Resized(step=event.step, from_dp=from_dp, dp=self._dp, seconds=round(time.time() - since, 2), time=time.time()))
            self._resize_from = None
        if isinstance(event, Start) and self._failed_at is not None:
            self._redone = max(0, self._last_step - event.step)
        if isinstance(event, Step):
            self._last_step, self._progress_at = event.step, time.time()
        self._events.append(event.model_copy(update={"time": time.time()}))
        for new in self._events[before:]:
            self._metrics.observe(new)

    def snapshot_taken(self, step: int, world: int, attempt: int) -> None:
        """Rank 0: every rank's files of the snapshot at `step` are kept."""
        with self._lock:
            if attempt == self._attempt:
                self._keepers.taken(step, world)

    def run(self) -> JobResult:
        spec = JobSpec.model_validate(self.spec_dict)
        budget = FailureBudget.of(spec.fault_tolerance, self._failures)
        capacity = self._capacity = Capacity(
            spec, self._pg_name("slot/"), lambda event: self.report(event.model_copy(update={"step": self._last_step})), self.placement_timeout_s
        )
        try:
            current = capacity.initial(spares_optional=bool(budget.failures))
            while True:
                try:
                    result = self._run_once(current)
                except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError, RankHung) as err:
                    cause = err.cause if isinstance(err, ray.exceptions.RayTaskError) else err
                    if isinstance(cause, (Diverged, OutOfMemory)):
                        self._new_attempt(failed=False)
                        current = self._roll_back(current, cause) if isinstance(cause, Diverged) else self._shrink_micro_batch(current, cause)
                        continue
                    if isinstance(cause, (UserError, CheckpointWritesFailing)) or budget.used_up:
                        raise
                    attempt = budget.spend()
                    noticed = time.time()
                    self._new_attempt(failed=True)
                    capacity.find_lost(self._rank_nodes, since=self._raised_at or noticed)
                    self.report(
                        Failure(
                            attempt=attempt,
                            max_failures=budget.max_failures,
                            step=self._last_step,
                            cause=f"{type(cause).__name__}: {first_line(cause)}",
                            rank=self._failed_rank,
                            nodes_lost=self._nodes_lost(self._layout),
                            noticed=noticed,
                            raised=self._raised_at,
                        )
                    )
                    budget.wait()
                    current = capacity.fit(current)
                    continue
                if not result.stopped:
                    return result
                # Stopped at a committed checkpoint because more ranks fit now: grow.
                self._new_attempt(failed=False)
                self._resize_from = (self._dp, time.time())
                current = capacity.fit(current)
        finally:
            self._stop_reader()  # after a success it was counted and stopped already
            for worker, _ in self._idle:
                ray.kill(worker, no_restart=True)
            if self._keepers:
                self._keepers.stop()
            capacity.release()

    def _roll_back(self, spec: JobSpec, cause: Diverged) -> JobSpec:
        """Restart from the latest checkpoint, skipping the batches of the steps that
        were not finite or spiked."""
        self._rollbacks += 1
        if self._rollbacks > spec.guards.max_rollbacks:
            raise TrainingFailed(f"{cause}; guards.max_rollbacks {spec.guards.max_rollbacks} rollbacks are used up")
        skip = sorted(set(spec.guards.skip_batches) | set(cause.steps))
        if self._keepers:
            self._keepers.forget()  # snapshots of the steps that went wrong are not a place to return to
        self.report(
            Rollback(
                step=self._last_step,
                steps=cause.steps,
                skip_batches=skip,
                cause=str(cause),
                rollback=self._rollbacks,
                max_rollbacks=spec.guards.max_rollbacks,
            )
        )
        return spec.with_changes("guards", skip_batches=skip)

    def _shrink_micro_batch(self, spec: JobSpec, cause: OutOfMemory) -> JobSpec:
        """Retry from the latest checkpoint with a smaller micro-batch (more accumulation,
        the same global batch), or fail with the memory report once at the floor."""
        smaller = with_smaller_micro_batch(spec)
        report_name = f"memory-oom-step{cause.step}-rank{cause.rank}.txt"
        self.report(
            OutOfMemoryEvent(
                step=cause.step,
                rank=cause.rank,
                micro_batch=cause.micro_batch,
                retry_micro_batch=smaller.train.micro_batch if smaller else None,
                report=cause.report,
                report_name=report_name,
            )
        )
        if smaller is None:
            raise TrainingFailed(
                f"{cause}, and no smaller micro-batch is left (guards.oom_min_micro_batch "
                f"{spec.guards.oom_min_micro_batch}); the memory report is {report_name} in the run directory"
            )
        return smaller

    def _new_attempt(self, failed: bool) -> None:
        with self._lock:  # from here on, reports of the previous attempt are dropped
            self._attempt += 1
            self._in_order = InOrder()
            if failed:
                self._failed_at, self._failed_layout = time.time(), self._layout

    def _pg_name(self, role: str) -> str:
        job = self.spec_dict["name"]
        return placement.owner_prefix(job, ray.get_runtime_context().get_actor_id()) + role

    def grow_pending(self) -> bool:
        """Asked by rank 0 at each checkpoint: stop there, so the job can grow?"""
        return self._capacity is not None and self._capacity.growth_pending

    def _run_once(self, spec: JobSpec) -> JobResult:
        controller_handle = ray.get_runtime_context().current_actor
        world, tp, res = spec.world_size, spec.parallel.tp, spec.resources
        self._dp = spec.parallel.dp
        spec_dict = spec.model_dump(mode="json", exclude_unset=True)
        self._progress_at = None
        results: list = []
        try:
            reader = self._start_reader(spec)  # starting while the group forms
            reused = self._start_workers(world, tp, res.cpus_per_worker, res.gpus_per_worker)
            self._layout = self._rendezvous(MeshShape.for_spec(spec.parallel))
            self.report(Layout(ranks=self._layout, reused=reused))
            first_on_node = {node: rank for rank, node in reversed(list(enumerate(self._rank_nodes)))}
            snapshots = self._snapshots()
            refs = self._train_refs = [
                w.train.remote(spec_dict, self.manifest, controller_handle, self._attempt, rank in first_on_node.values(), reader, snapshots[rank])
                for rank, w in enumerate(self._workers)
            ]
            self._start_standby(spec)
            results = self._wait_all(refs, spec)
            try:
                ray.get([w.shutdown.remote() for w in self._workers], timeout=60)
            except ray.exceptions.RayError:
                pass  # training finished and was reported; the actors are killed next anyway
            if not results[0].stopped:  # the job is done; a stop to grow keeps its reader
                self._stop_reader(count=True)
            return JobResult(**dict(results[0]), world_size=world, dp=spec.parallel.dp, data_bytes_read=self._bytes_read)
        finally:
            # DeepSpeed keeps state of its own per process: its ranks always start afresh.
            self._teardown(reuse=spec.engine == "native" and spec.fault_tolerance.keep_survivors)

    def _start_reader(self, spec: JobSpec):
        """One reader for the whole job: every DP rank's slice of each step is read once,
        and handed to that rank's TP and PP peers alike. The reader of an earlier
        attempt is kept, laid out anew, while its node lives; else one starts in rank 0's slot's node."""
        layout = BatchLayout(spec.train.global_batch, spec.train.micro_batch, spec.parallel.dp)
        serves, sharers = list(range(spec.parallel.dp)), spec.parallel.tp * spec.parallel.pp
        if self._reader is not None and self._reader_node in self._capacity.alive_nodes():
            try:
                ray.get(self._reader.relayout.remote(layout, serves, sharers), timeout=READER_ANSWER_S)
                self.report(Reader(kept=True, node=self._reader_node[:12]))
                return self._reader
            except (ray.exceptions.RayError, TimeoutError):
                pass  # gone, or too slow to trust: a new one
        self._stop_reader()
        datasets, mixture = datasets_of(spec, self.manifest)
        self._reader_node = self._capacity.slots.nodes()[0]
        self._reader = start_reader(datasets, mixture, layout, serves, sharers, teacher_cache(spec), self._reader_node, served_scorer(spec.distill))
        if self._starts_at_step_0(spec):  # read the first steps while the ranks load torch
            self._reader.prefetch.remote(first_chunks(0, spec.data.prefetch_steps, spec.train.max_steps))
        self.report(Reader(kept=False, node=self._reader_node[:12]))
        return self._reader

    def _starts_at_step_0(self, spec: JobSpec) -> bool:
        """The ranks will start at step 0: the job's first attempt under its first
        controller, with no committed checkpoint to restore."""
        if self._attempt or self._replacement:
            return False
        try:
            return not CheckpointStore(spec.checkpoint_dir).committed()
        except OSError:  # unreadable now: the ranks will say so; nothing is read ahead
            return False

    def _snapshots(self) -> list:
        """Per rank, (its keepers, the snapshot to restore) with `checkpoint.in_memory`, else None."""
        if self._keepers is None:
            return [None] * len(self._workers)
        keepers = self._keepers.place(self._rank_nodes, self._capacity.alive_nodes())
        source = self._keepers.source()
        if source is None and self._keepers.latest is not None:
            self._keepers.forget()  # what is left of an incomplete one must not pass for new
        return [(mine, source) for mine in keepers]

    def _stop_reader(self, count: bool = False) -> None:
        """Stops the job's reader; `count`: first adds what it read (a reader being
        replaced is not asked: it may have gone with its node)."""
        if self._reader is None:
            return
        if count:
            self._bytes_read += ray.get(self._reader.bytes_read.remote(), timeout=60)
        ray.kill(self._reader, no_restart=True)
        self._reader = None

    def _nodes_lost(self, layout: list[dict]) -> list[str]:
        alive = {node[:12] for node in self._capacity.alive_nodes()}
        return sorted({rank["node"] for rank in layout} - alive)

    def _wait_all(self, refs: list, spec: JobSpec) -> list:
        """Like ray.get, but raises as soon as any rank fails (instead of waiting on the
        survivors, which would block forever in their next collective), or when no
        step has been reported for `step_timeout_s`: a hung rank holds up all others."""
        pending = list(refs)
        self._failed_rank = self._raised_at = None
        step_timeout_s = spec.fault_tolerance.step_timeout_s
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            if not done:
                self._capacity.probe(spec)
                self._start_standby(spec)
                stalled = time.time() - self._progress_at if self._progress_at else 0.0
                if step_timeout_s and stalled > step_timeout_s:
                    hang, error = diagnose(self._last_step, self._rank_pids, self._rank_nodes, stalled, step_timeout_s)
                    self.report(hang)
                    self._failed_rank = hang.behind
                    raise error
                continue
            try:
                ray.get(done[0])
            except ray.exceptions.RayError as err:
                self._raised_at = time.time()
                self._failed_rank = refs.index(done[0])
                if isinstance(err, ray.exceptions.RayTaskError):
                    raise self._dead_peer(refs, pending) or err from None
                raise
        return ray.get(refs)

    def _dead_peer(self, refs: list, pending: list, grace_s: float = 1.0):
        """A rank that raised because a peer vanished (gloo: "Connection closed by
        peer") shows a symptom; if a peer's actor turns out dead within moments, that
        is the cause to report."""
        deadline = time.time() + grace_s
        while pending and time.time() < deadline:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.time()))
            for ref in done:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as err:
                    self._failed_rank = refs.index(ref)
                    return err
                except ray.exceptions.RayError:
                    pass
        return None

    def _start_workers(self, world: int, tp: int, cpus: float, gpus: float) -> int:
        """A worker per rank in its TP group's slot: one kept from the last attempt in
        that slot where there is one, else a new one. Returns how many were kept."""
        idle, reused = self._idle, 0
        self._idle = []
        for rank in range(world):
            slot = self._capacity.slots.group(rank // tp)
            kept = next((pair for pair in idle if pair[1].id == slot.id), None)
            if kept is not None:
                idle.remove(kept)
                worker, reused = kept[0], reused + 1
            else:
                worker = Worker.options(num_cpus=cpus, num_gpus=gpus, scheduling_strategy=self._capacity.slots.strategy(rank // tp)).remote(
                    rank, world
                )
            self._workers.append(worker)
            self._worker_slots.append(slot)
        for worker, _ in idle:  # their slots are gone, or the layout is smaller
            ray.kill(worker, no_restart=True)
        return reused

    def _start_standby(self, spec: JobSpec) -> None:
        """Workers for the slots beyond the layout (spares, room reserved to grow),
        started now so that a restart or a resize finds them with torch loaded."""
        tp, res = spec.parallel.tp, spec.resources
        started = {slot.id for _, slot in self._standby}
        for index in range(spec.world_size // tp, len(self._capacity.slots)):
            slot = self._capacity.slots.group(index)
            if slot.id not in started:
                strategy = self._capacity.slots.strategy(index)
                self._standby += [
                    (Worker.options(num_cpus=res.cpus_per_worker, num_gpus=res.gpus_per_worker, scheduling_strategy=strategy).remote(-1, 0), slot)
                    for _ in range(tp)
                ]

    def _rendezvous(self, shape: MeshShape) -> list[dict]:
        addresses: list[RankAddress] = ray.get([w.address.remote() for w in self._workers])
        self._rank_nodes, self._rank_pids = [a.node for a in addresses], [a.pid for a in addresses]
        world = len(self._workers)
        ray.get([w.setup.remote(addresses[0].ip, addresses[0].port, rank, world) for rank, w in enumerate(self._workers)])
        return [{"rank": r, **shape.coordinates(r), "ip": a.ip, "node": a.node[:12]} for r, a in enumerate(addresses)]

    def _teardown(self, reuse: bool) -> None:
        """End the attempt's workers. With `reuse`, those whose training returned (or
        raised) and that leave their process groups within LEAVE_S are kept for the
        next attempt; the rest (dead, or still blocked in a collective) are killed."""
        keep: list[tuple] = []
        if reuse and self._train_refs:
            done, _ = ray.wait(self._train_refs, num_returns=len(self._train_refs), timeout=LEAVE_S)
            alive = [(w, slot) for w, slot, ref in zip(self._workers, self._worker_slots, self._train_refs) if ref in done and _returned(ref)]
            leaving = {w.leave.remote(): (w, slot) for w, slot in alive}
            left, _ = ray.wait(list(leaving), num_returns=len(leaving), timeout=LEAVE_S) if leaving else ([], [])
            keep = [leaving[ref] for ref in left if _returned(ref)]
        kept = {id(w) for w, _ in keep}
        for worker in self._workers:
            if id(worker) not in kept:
                ray.kill(worker, no_restart=True)
        self._idle, self._workers, self._worker_slots, self._train_refs = keep + self._standby, [], [], []
        self._standby = []


def _returned(ref) -> bool:
    """The call ended with a value or the method's own error (its actor lives)."""
    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayTaskError:
        return True
    except ray.exceptions.RayError:
        return False
    return True

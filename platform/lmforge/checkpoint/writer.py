"""Writing checkpoints in the background while training goes on.

`save()` copies the state into CPU memory (DCP's stager, reusing its buffers; on
GPUs in the background, overlapping the next step's forward and backward, with
`staged()` called before that step changes any weight) and returns. A thread then does the rest: DCP's write, this rank's RNG, an agreement that
every rank succeeded, checksums (each rank hashes a share of the files), and rank
0's commit marker and pruning. The thread talks only on the checkpoint's own
gloo group, so its collectives never interleave with training's. A failed write is
reported and training goes on, until `checkpoint.max_failed_writes` fail in a row.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from lmforge.checkpoint.config import CheckpointSpec
from lmforge.checkpoint.sharded import dcp_writer, rng_state, write_rng
from lmforge.checkpoint.state import TrainerState
from lmforge.checkpoint.stateful import Checkpointable
from lmforge.checkpoint.store import CheckpointStore
from lmforge.errors import CheckpointWritesFailing
from lmforge.events import Checkpoint, CheckpointFailed, Event


class BackgroundSaver:
    """What a checkpoint and an in-memory snapshot save alike: DCP's asynchronous
    save on a gloo group of their own, and one thread that finishes each save."""

    def __init__(self, group: dist.ProcessGroup, name: str):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._pending: Optional[Future] = None
        self._staging: Optional[Future] = None
        # One stager for the whole run: it keeps its CPU copies (pinned on GPUs) and
        # refills them at each save instead of allocating the state's size again. Safe
        # because a save first waits for the previous write to finish. On GPUs the
        # device-to-host copy runs on a side stream during the next forward and
        # backward; on CPU ranks a background copy would hold the GIL against the
        # training thread (measured: slower than copying right away).
        cuda = torch.cuda.is_available()
        self._stager = DefaultStager(
            StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=cuda, use_non_blocking_copy=cuda)
        )

    def _async_save(self, tensors: dict, storage_writer) -> Future:
        """Staged synchronously on CPU ranks, in the background on GPUs; returns the write."""
        response = dcp.async_save(tensors, storage_writer=storage_writer, process_group=self.group, async_stager=self._stager)
        if isinstance(response, AsyncSaveResponse):  # staging goes on in the background
            self._staging = response.staging_completion
            return response.upload_completion
        return response

    def staged(self) -> None:
        """Block until the state being saved has been copied: call before changing it."""
        if self._staging is not None:
            staging, self._staging = self._staging, None
            staging.result()

    def _finished(self):
        """Block until the save in flight is finished; its thread's result (None: none was)."""
        self.staged()
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        return pending.result()  # a dead peer raises here: that is a rank failure

    def wait(self) -> None:
        self._finished()

    def settle(self, timeout_s: float) -> None:
        """After a failure: give the save in flight up to `timeout_s` to finish, its
        errors ignored (a dead peer's would only repeat the failure)."""
        if self._pending is not None:
            futures_wait([self._pending], timeout=timeout_s)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._thread.shutdown(wait=True)
            self._stager.close()


class CheckpointWriter(BackgroundSaver):
    def __init__(self, store: CheckpointStore, options: CheckpointSpec, group: dist.ProcessGroup, report: Callable[[Event], None]):
        super().__init__(group, "checkpoint")
        self.store, self.options = store, options
        self.report = report  # called on rank 0 only, from the writer thread too
        self.failed_in_a_row = 0

    def save(self, step: int, engine: Checkpointable, trainer_state: TrainerState) -> None:
        """Collective over every rank at the same step. Training is held up while the
        previous write finishes (`stall_seconds`), and later in `staged()` if the copy
        is slower than a forward and backward."""
        began = time.perf_counter()
        self.wait()
        path = self.store.step_path(step)
        rng = rng_state()
        plain: dict = {}
        if engine.checkpoint_format == "dcp":
            tensors, plain = engine.state_dict()
            upload = self._async_save(tensors, dcp_writer(self.store, path))
        else:
            engine.save(self.store.fs_path(path))  # DeepSpeed writes synchronously, on its own
            upload = None
        state = trainer_state.model_copy(update={"engine": plain, "format": engine.checkpoint_format})
        stall = time.perf_counter() - began
        self._pending = self._thread.submit(self._finish, step, upload, rng, state, began, stall)
        if not self.options.async_save:
            self.wait()

    def wait(self) -> None:
        """Block until the write in flight (if any) is committed or has failed."""
        ok = self._finished()
        if ok is None:
            return
        self.failed_in_a_row = 0 if ok else self.failed_in_a_row + 1
        if self.failed_in_a_row >= self.options.max_failed_writes:
            raise CheckpointWritesFailing(
                f"{self.failed_in_a_row} checkpoints in a row could not be written to {self.store.root} "
                f"(checkpoint.max_failed_writes {self.options.max_failed_writes}); see the checkpoint_failed events"
            )

    def _finish(self, step: int, upload: Optional[Future], rng: dict, state: dict, began: float, stall: float) -> bool:
        error = None
        try:
            if upload is not None:
                upload.result()
            write_rng(self.store, self.store.step_path(step), self.rank, rng)
            if self.rank == 0:
                self.store.write_state(step, state)
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - a write error is reported, not fatal
            error = _describe(err)
        errors = [None] * self.world
        dist.all_gather_object(errors, error, group=self.group)
        failed = {rank: err for rank, err in enumerate(errors) if err}
        if failed:
            rank, first = next(iter(failed.items()))
            self._event(
                CheckpointFailed(
                    step=step,
                    error=f"rank {rank}: {first}",
                    ranks=sorted(failed),
                    failed_in_a_row=self.failed_in_a_row + 1,
                    max_failed_writes=self.options.max_failed_writes,
                )
            )
            return False
        names = self.store.files(step)
        share = self.store.digest(step, names[self.rank :: self.world])
        shares = [None] * self.world if self.rank == 0 else None
        dist.gather_object(share, shares, dst=0, group=self.group)
        if self.rank == 0:
            self.store.commit(step, {name: meta for part in shares for name, meta in part.items()})
            pruned = self.store.prune(self.options.keep, self.options.keep_every)
            seconds = time.perf_counter() - began
            self._event(
                Checkpoint(
                    step=step,
                    path=self.store.step_path(step),
                    seconds=seconds,
                    stall_seconds=stall if self.options.async_save else seconds,
                    pruned=pruned,
                )
            )
        return True

    def _event(self, event: Event) -> None:
        if self.rank == 0:
            self.report(event)


def _describe(err: BaseException) -> str:
    """One line; for DCP's collective exception, the first rank's own error."""
    if isinstance(err, CheckpointException) and err.failures:
        err = next(iter(err.failures.values()))[0]
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"

"""The Worker actor: one per rank. Joins the process group, then runs the Trainer.

It is deliberately thin: everything that trains lives in `lmforge.trainer` so it
can run without Ray actors too. A worker outlives a failed attempt: it leaves its
process groups at once (so peers blocked on it fail too, instead of waiting out a
timeout) and can join the next attempt's rendezvous under another rank, with torch
and the model code already loaded.
"""

from __future__ import annotations

import itertools
import os
import socket
import traceback
from datetime import timedelta

import ray
from pydantic import BaseModel

from lmforge.cluster.keepers import SnapshotShipper
from lmforge.data.manifest import Manifest
from lmforge.events import RankResult
from lmforge.ray_runtime import WORKER_ENV, tune_process
from lmforge.spec import JobSpec
from lmforge.tracking.prometheus import RankMetrics
from lmforge.tracking.system_metrics import start_monitor, stop_monitor


class RankAddress(BaseModel):
    ip: str
    port: int  # free on its node: rank 0's is the rendezvous
    node: str  # Ray's node id
    pid: int  # its process (a hang's stacks are read from it)


SETTLE_S = 2.0  # after a failure, how long a checkpoint being written may take to finish (and commit)


@ray.remote(num_cpus=0)
class Worker:
    def __init__(self, rank: int, world_size: int):
        # Set here, before torch loads, rather than as the actor's runtime_env: an actor
        # with a runtime_env of its own cannot take one of Ray's idle worker processes
        # and waits for a new one to start (measured: ~0.75 s more per 2-rank launch).
        os.environ.update(WORKER_ENV)
        import lmforge.trainer  # noqa: F401 - loaded while the other ranks start, not after the rendezvous

        tune_process(int(os.environ.get("OMP_NUM_THREADS", "1")))
        self.rank, self.world_size = rank, world_size

    def address(self) -> RankAddress:
        """Where this rank runs; rank 0's answer is the rendezvous."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return RankAddress(ip=ray.util.get_node_ip_address(), port=port, node=ray.get_runtime_context().get_node_id(), pid=os.getpid())

    def setup(self, master_addr: str, master_port: int, rank: int, world_size: int) -> None:
        import torch
        import torch.distributed as dist

        self.rank, self.world_size = rank, world_size
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(0)  # Ray exposes exactly the actor's GPU as device 0
        # What torchrun would set; DeepSpeed reads these (LOCAL_RANK: the device index).
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK="0", MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(minutes=5),
        )

    def train(
        self, spec_dict: dict, manifest: Manifest, controller, attempt: int = 0, watch_node: bool = False, reader=None, snapshots: tuple | None = None
    ) -> RankResult:
        """`watch_node`: this rank also samples its node's system metrics into the run;
        `reader`: the job's shared data reader; `snapshots`: (this rank's keepers, the
        snapshot to restore or None) with `checkpoint.in_memory`."""
        from lmforge.trainer import Trainer  # torch, after this process's environment is set (__init__)

        spec = JobSpec.model_validate(spec_dict)
        monitor = trainer = None
        try:
            # Tagged with the attempt (a report still in flight from a failed attempt is
            # dropped) and numbered: the controller's threads may run them out of order.
            numbers = itertools.count()
            trainer = Trainer(
                spec,
                manifest,
                report=lambda event: controller.report.remote(event, attempt, next(numbers)),
                should_stop=lambda: ray.get(controller.grow_pending.remote()),
                metrics=RankMetrics(spec.name, self.rank),
                reader=reader,
                snapshot_target=SnapshotShipper(snapshots[0], controller, attempt) if snapshots else None,
                snapshot_source=snapshots[1] if snapshots else None,
            )
            monitor = start_monitor(spec, watch_node)
            return trainer.run()
        except BaseException as error:
            # Peers blocked in a collective with this rank fail only when its connections
            # close, and they close only when nothing holds its process groups: not the
            # trainer (nor a checkpoint thread still finishing), nor the frames the error
            # carries. Then they fail at once and are kept for the next attempt too.
            if trainer is not None:
                trainer.settle(SETTLE_S)
            trainer = None
            _drop_locals(error)
            self.leave()  # before the error travels: peers still waiting on this rank fail now
            raise
        finally:
            stop_monitor(monitor)

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()  # no rank tears gloo down while a peer still uses it
        self.leave()

    def leave(self) -> bool:
        """Leave every process group and forget what DTensor keeps per mesh: the next
        attempt starts as a fresh process would. DTensor's caches compare meshes by
        their ranks and shape, not by this process's place in them, so a process
        re-ranked in a mesh of the same shape would otherwise get its old rank's
        shards (seen: a checkpoint plan with every shard twice, half the tensor never)."""
        import gc

        import torch.distributed as dist
        import torch.distributed.tensor._random as dtensor_random
        import torch.distributed.tensor._redistribute as redistribute
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        if dist.is_initialized():
            dist.destroy_process_group()
        dtensor_random._rng_tracker = None
        _clear_sharding_prop_cache()
        redistribute._planner_cache.clear()
        gc.collect()
        return True


def _drop_locals(error: BaseException) -> None:
    """Clear the locals of the frames an error and the errors it came from carry
    (the engine among them); the traceback's lines stay."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__context__ or error.__cause__

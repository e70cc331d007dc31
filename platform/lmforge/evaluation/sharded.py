"""A model held by Ray actors on a tensor x pipeline layout, for evaluation: each rank
builds its pipeline stage and tensor-parallel shard straight from the model's files (no
export, no whole copy per rank), and the caller sends it batches. Activations pass
stage to stage; the logits stay on the last stage, where each batch is scored, and only
the scores come back."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Optional

import ray
import torch
import torch.distributed as dist
from pydantic import BaseModel, Field
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from torch.distributed.tensor import DTensor

from lmforge.checkpoint.export import open_source
from lmforge.errors import UserError
from lmforge.evaluation.scoring import ContinuationScore, continuation_scores, right_padded
from lmforge.models.build import materialize
from lmforge.models.llama import Transformer
from lmforge.parallel.mesh import ParallelDims, build_mesh
from lmforge.parallel.pipeline import cut_stage, split_layers
from lmforge.parallel.shape import MeshShape
from lmforge.parallel.tensor import apply_tensor_parallel
from lmforge.ray_runtime import WORKER_ENV, tune_process

PLACEMENT_WAIT_S = 120.0


class Layout(BaseModel):
    """Where a model runs for evaluation: tensor- and pipeline-parallel ranks."""

    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp


class ShardPlan(BaseModel):
    """What every rank is told: the model, its tokenizer's size and the layout."""

    model: str
    layout: Layout
    vocab: int  # the tokenizer's size: generation never picks a padded row
    threads: int = 1


@ray.remote(num_cpus=0)
class ModelShard:
    def __init__(self, threads: int):
        os.environ.update(WORKER_ENV)  # before torch computes anything, as a training rank does
        tune_process(threads)

    def address(self) -> tuple[str, int]:
        with socket.socket() as sock:
            sock.bind(("", 0))
            return ray.util.get_node_ip_address(), sock.getsockname()[1]

    def join(self, master: tuple[str, int], rank: int, plan: ShardPlan) -> None:
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        world = plan.layout.world_size
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{master[0]}:{master[1]}", rank=rank, world_size=world, timeout=timedelta(minutes=5))
        self.dims = build_mesh(self.device.type, MeshShape(pp=plan.layout.pp, dp_replicate=1, dp_shard=1, tp=plan.layout.tp))
        self.stage, self.vocab = _stage(plan, self.dims, self.device), plan.vocab

    @torch.no_grad()
    def score(self, inputs: list[list[int]], continuations: list[list[int]]) -> Optional[list[ContinuationScore]]:
        logits = self._logits(right_padded(inputs, self.device))
        return None if logits is None else continuation_scores(logits, inputs, continuations)

    @torch.no_grad()
    def next_token(self, tokens: list[int]) -> Optional[int]:
        logits = self._logits(torch.tensor([tokens], device=self.device))
        return None if logits is None else int(logits[0, -1, : self.vocab].float().argmax())

    def _logits(self, tokens: torch.Tensor) -> Optional[torch.Tensor]:
        """The whole vocabulary's logits on the last stage (every TP rank there); None elsewhere."""
        pp, stage = self.dims.shape.pp, self.dims.pp_rank
        if stage == 0:
            hidden = tokens
        else:
            hidden = torch.empty(*tokens.shape, self.stage.cfg.dim, dtype=self._dtype, device=self.device)
            dist.recv(hidden, src=self._peer(stage - 1))
        out = self.stage(hidden)
        if stage < pp - 1:
            dist.send(out.contiguous(), dst=self._peer(stage + 1))
            return None
        return out.full_tensor() if isinstance(out, DTensor) else out

    @property
    def _dtype(self) -> torch.dtype:
        return next(self.stage.parameters()).dtype

    def _peer(self, stage: int) -> int:
        """The global rank holding `stage` and this rank's tensor-parallel shard."""
        return stage * self.dims.shape.tp + self.dims.tp_mesh.get_local_rank()


def _stage(plan: ShardPlan, dims: ParallelDims, device: torch.device) -> Transformer:
    """This rank's blocks, loaded from the model's files, then split over its TP group."""
    source = open_source(plan.model)
    with torch.device("meta"):
        model = Transformer(source.cfg)
    pp = dims.shape.pp
    if pp > 1:
        ranges = split_layers(source.cfg, source.cfg.max_seq_len, pp)
        model = cut_stage(model, list(ranges[dims.pp_rank]), first=dims.pp_rank == 0, last=dims.pp_rank == pp - 1)
    model = materialize(model, device, 0, source.read_tensors())
    if dims.shape.tp > 1:
        apply_tensor_parallel(model, dims.tp_mesh, sequence_parallel=False)
    return model.eval()


class ShardedModel:
    """The caller's side: the rank actors in one placement group (a PACKed group keeps a
    tensor-parallel group on as few nodes as fit), started, joined and stopped."""

    def __init__(self, plan: ShardPlan):
        world, self.plan = plan.layout.world_size, plan
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= world else 0.0
        self.group = placement_group([{"CPU": 1.0, "GPU": gpus} if gpus else {"CPU": 1.0}] * world, strategy="PACK")
        self.ranks: list = []
        try:
            if not self.group.wait(timeout_seconds=PLACEMENT_WAIT_S):
                raise UserError(
                    f"--set parallel: {world} ranks (tp {plan.layout.tp} x pp {plan.layout.pp}) found no room on the cluster within "
                    f"{PLACEMENT_WAIT_S:.0f}s (it has {ray.available_resources().get('CPU', 0):g} CPUs free)"
                )
            self.ranks = [
                ModelShard.options(
                    num_cpus=1, num_gpus=gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=i)
                ).remote(plan.threads)
                for i in range(world)
            ]
            master = ray.get(self.ranks[0].address.remote())
            ray.get([rank.join.remote(master, i, plan) for i, rank in enumerate(self.ranks)])
        except BaseException:
            self.close()
            raise
        self.last = (plan.layout.pp - 1) * plan.layout.tp  # a rank of the last stage

    def score(self, inputs: list[list[int]], continuations: list[list[int]]) -> list[ContinuationScore]:
        return ray.get([rank.score.remote(inputs, continuations) for rank in self.ranks])[self.last]

    def next_token(self, tokens: list[int]) -> int:
        return ray.get([rank.next_token.remote(tokens) for rank in self.ranks])[self.last]

    def close(self) -> None:
        for rank in self.ranks:
            ray.kill(rank)
        remove_placement_group(self.group)

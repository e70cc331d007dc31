"""The job's DeviceMesh with dims (pp, dp_replicate, dp_shard, tp).

Every process group a rank uses comes from this mesh; nothing is kept in globals.
ZeRO 0 puts the data-parallel ranks on `dp_replicate` (plain replication), ZeRO
2/3 on `dp_shard` (FSDP2 sharding), or on both with `dp_replicate > 1` (HSDP).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lmforge.parallel.shape import MESH_DIMS, MeshShape


@dataclass
class ParallelDims:
    """A rank's mesh plus the sub-meshes the engine needs, built once."""

    mesh: DeviceMesh
    shape: MeshShape

    @property
    def dp_mesh(self) -> DeviceMesh:
        """Both data-parallel dims together: FSDP2 treats (replicate, shard) as HSDP."""
        return self.mesh["dp_replicate", "dp_shard"]

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh["pp"].get_group()

    @property
    def pp_rank(self) -> int:
        return self.mesh["pp"].get_local_rank()

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh["dp_replicate", "dp_shard"]._flatten("dp").get_group()

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_coordinate()[0] * self.shape.dp_shard + self.dp_mesh.get_coordinate()[1]


def build_mesh(device_type: str, shape: MeshShape) -> ParallelDims:
    if dist.get_world_size() != shape.pp * shape.dp * shape.tp:
        raise RuntimeError(f"world size {dist.get_world_size()} != mesh {shape.dims}")
    mesh = init_device_mesh(device_type, shape.dims, mesh_dim_names=MESH_DIMS)
    return ParallelDims(mesh=mesh, shape=shape)

"""FSDP2 CPU offload is applied whenever a job asks for it, one fp32 data-parallel
rank included (which needs no FSDP otherwise): every unit under the offload policy,
every parameter's shard in host memory, and the same training as without it. A job
asks for it only with GPUs (torch pins host memory for them); here the engine is
built on CPU with the setting put in after the job's validation."""

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor import DTensor

from lmforge.engines.native import NativeEngine
from lmforge.parallel.mesh import build_mesh
from lmforge.parallel.shape import MeshShape
from lmforge.spec import spec_from_dict
from lmforge.trainer import job_loss

LAYERS = 2


def engine(cpu_offload: bool) -> NativeEngine:
    spec = spec_from_dict(
        {
            "name": "t",
            "data": {"path": "d"},
            "model": {"preset": "tiny", "vocab_size": 96, "n_layers": LAYERS},
            "optim": {"lr": 1e-2, "warmup_steps": 1},
            "train": {"global_batch": 4, "micro_batch": 2, "seq_len": 16},
        }
    )
    spec.parallel.cpu_offload = cpu_offload
    return NativeEngine(spec, build_mesh("cpu", MeshShape.for_spec(spec.parallel)), torch.device("cpu"), job_loss(spec, 96))


def test_offload_is_applied_at_one_fp32_rank_and_trains_as_without(one_rank):
    plain, offloaded = engine(False), engine(True)
    assert not any(isinstance(m, FSDPModule) for m in plain.parts[0].modules())
    units = [m for m in offloaded.parts[0].modules() if isinstance(m, FSDPModule)]
    assert len(units) == LAYERS + 1  # each block, and the root
    for unit in units:
        group = unit._get_fsdp_state()._fsdp_param_group
        assert isinstance(group.offload_policy, CPUOffloadPolicy)
        assert group.fsdp_params and all(param.offload_to_cpu for param in group.fsdp_params)
    assert all(isinstance(p, DTensor) and p.to_local().device.type == "cpu" for p in offloaded.parts[0].parameters())
    tokens = torch.randint(0, 96, (2, 2, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        assert offloaded.train_step(tokens).loss == pytest.approx(plain.train_step(tokens).loss, rel=1e-6)

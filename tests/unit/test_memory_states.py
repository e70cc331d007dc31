"""Model-state bytes: the DeepSpeed figures against DeepSpeed's own estimators, and
the splitting rules. (The native engine's figures are checked exactly, rank by rank,
against the tensors every parity run allocates: tests/integration/parity.py.)"""

import pytest
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from lmforge.memory.states import chunk_size, deepspeed_states, largest_module_params, local_numel
from lmforge.models.config import PRESETS

MODELS = [PRESETS["small"], PRESETS["1b"], PRESETS["small"].with_overrides(tie_embeddings=True)]


@pytest.mark.parametrize("cfg", MODELS)
@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_zero2_matches_deepspeeds_estimator(cfg, gpus):
    psi = cfg.num_params()
    cpu, gpu = estimate_zero2_model_states_mem_needs(psi, num_gpus_per_node=gpus, cpu_offload=False)
    assert deepspeed_states(cfg, gpus, "bf16", stage=2).total == pytest.approx(gpu, abs=4)  # each term truncated
    cpu, gpu = estimate_zero2_model_states_mem_needs(psi, num_gpus_per_node=gpus, cpu_offload=True, additional_buffer_factor=1.0)
    offloaded = deepspeed_states(cfg, gpus, "bf16", stage=2, offload_optimizer="cpu")
    assert offloaded.total == gpu
    if gpus <= 4:  # beyond, DeepSpeed sizes the host for 4 bytes per parameter per GPU instead
        assert offloaded.host * gpus == pytest.approx(cpu, abs=4 * gpus)


@pytest.mark.parametrize("cfg", MODELS[:2])
def test_nvme_offload_counts_as_disk_not_host(cfg):
    """ZeRO-Infinity: what goes to NVMe leaves host memory; the fp32 gradient
    partition stays there, and the device holds the same as with CPU offload."""
    to = lambda device, params: deepspeed_states(cfg, 4, "bf16", stage=3, offload_optimizer=device, offload_params=device if params else "none")
    for params in (False, True):
        cpu, nvme = to("cpu", params), to("nvme", params)
        assert nvme.total == cpu.total and nvme.host + nvme.disk == cpu.host
        grads32 = 4 * cfg.num_params() // 4
        assert nvme.host == pytest.approx(grads32, abs=4) and nvme.disk > 0
    assert deepspeed_states(cfg, 4, "bf16", stage=2, offload_optimizer="nvme", offload_params="nvme").disk == to("nvme", False).disk


@pytest.mark.parametrize("cfg", MODELS)
@pytest.mark.parametrize("gpus", [1, 2, 8])
@pytest.mark.parametrize("offload", ["none", "optimizer", "params"])
def test_zero3_matches_deepspeeds_estimator(cfg, gpus, offload):
    psi, largest = cfg.num_params(), largest_module_params(cfg)
    cpu, gpu, largest_memory = estimate_zero3_model_states_mem_needs(
        psi, largest, num_gpus_per_node=gpus, cpu_offload=offload != "none", cpu_offload_params=offload == "params", additional_buffer_factor=1.0
    )
    ours = deepspeed_states(
        cfg, gpus, "bf16", stage=3, offload_optimizer="cpu" if offload != "none" else "none", offload_params="cpu" if offload == "params" else "none"
    )
    assert ours.largest_unit == largest_memory
    assert ours.total + ours.largest_unit == pytest.approx(gpu, abs=4)
    if offload != "none":
        assert ours.host * gpus == pytest.approx(cpu, abs=4 * gpus)


def test_zero1_partitions_only_the_optimizer():
    cfg, n = PRESETS["1b"], 8
    psi = cfg.num_params()
    one = deepspeed_states(cfg, n, "bf16", stage=1)
    assert (one.params, one.grads) == (2 * psi, 2 * psi + 4 * psi // n) and one.optimizer == 12 * psi // n


def test_chunks_follow_torch_chunk():
    assert [chunk_size(10, 4, i) for i in range(4)] == [3, 3, 3, 1]
    assert [chunk_size(5, 4, i) for i in range(4)] == [2, 2, 1, 0]  # torch.chunk gives only 3 parts
    # wq is column-split over tp (dim 0), then FSDP splits the TP shard's dim 0 again
    assert local_numel("layers.0.attention.wq.weight", (64, 64), tp=2, tp_rank=1, dp_shard=4, dp_shard_rank=3) == 8 * 64
    # w2 is row-split (dim 1); norms are replicated over tp
    assert local_numel("layers.0.feed_forward.w2.weight", (64, 172), tp=2, tp_rank=0, dp_shard=1, dp_shard_rank=0) == 64 * 86
    assert local_numel("layers.0.ffn_norm.weight", (64,), tp=2, tp_rank=0, dp_shard=2, dp_shard_rank=1) == 32

"""The per-rank breakdown: pipeline in-flight counts, which rank is the worst, and
how layout choices move the figures the way they must."""

import pytest

from lmforge.memory.estimate import estimate, in_flight, worst_rank
from lmforge.planner.report import breakdown_table
from lmforge.spec import spec_from_dict


def job(**parallel):
    return spec_from_dict(
        {
            "name": "m",
            "model": {"preset": "1b", "tie_embeddings": False},
            "parallel": parallel,
            "train": {"global_batch": 64, "micro_batch": 1, "seq_len": 2048, "precision": "bf16"},
            "data": {"path": "unused"},
        }
    )


def test_in_flight_micro_batches_per_schedule():
    assert [in_flight("1f1b", 4, 1, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight("1f1b", 4, 1, 2, 0) == 2  # never more than there are
    assert in_flight("gpipe", 4, 1, 8, 3) == 8
    assert [in_flight("interleaved-1f1b", 4, 2, 8, r) for r in range(4)] == [11, 9, 7, 5]
    assert in_flight("1f1b", 1, 1, 8, 0) == 1


def test_first_pipeline_stage_is_the_worst_under_1f1b():
    spec = job(pp=4, dp=1, zero=3)
    assert worst_rank(spec).rank == 0
    assert estimate(spec, 0).activations > estimate(spec, 3).activations


def test_sharding_and_checkpointing_move_the_right_terms():
    base = estimate(job(dp=8, zero=3), 0)
    replicated = estimate(job(dp=8, zero=0), 0)
    assert replicated.optimizer > 7 * base.optimizer and replicated.params > 7 * base.params
    full_ac = estimate(job(dp=8, zero=3, activation_checkpointing="full"), 0)
    assert full_ac.activations < base.activations / 5 and full_ac.optimizer == base.optimizer
    tp = estimate(job(dp=1, tp=8, zero=3), 0)
    assert tp.activations < base.activations / 4 and tp.temporary < base.temporary


@pytest.mark.parametrize(
    "parallel",
    [
        {"pp": 2, "dp": 2, "tp": 2, "zero": 3},
        {"pp": 1, "dp": 3, "tp": 1, "zero": 2},  # uneven FSDP chunks
        {"pp": 4, "dp": 1, "tp": 2, "zero": 0, "schedule": "interleaved-1f1b", "virtual_stages": 2},
    ],
)
def test_worst_rank_checks_one_rank_per_stage_yet_finds_the_maximum(parallel):
    spec = spec_from_dict(
        {
            "name": "m",
            "model": {"preset": "small", "n_layers": 8},
            "parallel": parallel,
            "train": {"global_batch": 24, "micro_batch": 1, "seq_len": 64},
            "data": {"path": "unused"},
        }
    )
    every = max((estimate(spec, rank) for rank in range(spec.world_size)), key=lambda b: b.device_total)
    assert worst_rank(spec).device_total == every.device_total


def test_a_distillation_counts_its_teacher_and_adapters(tmp_path):
    """The frozen teacher's fp32 weights (FSDP-split like the student's), its logits for
    one micro-batch, and the adapters as trained parameters; the fit message names the
    teacher. (The parity runs check these bytes against what the engine allocates.)"""
    from lmforge.models.build import build_model
    from lmforge.models.config import PRESETS
    from lmforge.models.weights import write_model_dir
    from lmforge.planner.fit import describe

    teacher_cfg = PRESETS["small"]
    write_model_dir(tmp_path / "teacher", "lmforge", teacher_cfg, build_model(teacher_cfg).state_dict())
    tree = {
        "name": "d",
        "model": {"preset": "tiny", "vocab_size": 8192},
        "parallel": {"dp": 2},
        "train": {"global_batch": 8, "micro_batch": 2, "seq_len": 128},
        "data": {"path": "unused"},
    }
    plain = estimate(spec_from_dict(tree), 0)
    distill = {"teacher": str(tmp_path / "teacher"), "hidden": {"layers": {0: 1, 1: 3}}}
    with_teacher = estimate(spec_from_dict(tree | {"distill": distill}), 0)
    assert with_teacher.teacher == 4 * teacher_cfg.num_params() / 2  # every tensor's dim 0 splits evenly over 2 here
    adapters = 2 * 128 * 64 // 2  # two (teacher dim x student dim) adapters, FSDP-split over 2
    assert with_teacher.params - plain.params == 4 * adapters
    assert with_teacher.optimizer - plain.optimizer == 2 * 4 * adapters + 2 * 4  # two moments, a step scalar each
    assert with_teacher.temporary - plain.temporary == 2 * 128 * 8192 * 4  # the teacher's fp32 logits of one micro-batch
    # weights, gradients and two moments of the adapters, and their two step scalars
    assert with_teacher.device_total - plain.device_total == with_teacher.teacher + 4 * 4 * adapters + 8 + 2 * 128 * 8192 * 4
    assert "teacher " in describe(with_teacher) and "teacher " not in describe(plain)
    # Under DeepSpeed the teacher is a whole copy on every rank, beside the ZeRO-partitioned student.
    zero3 = tree | {"engine": "deepspeed", "deepspeed": {"config": {"zero_optimization": {"stage": 3}}}}
    ds_plain = estimate(spec_from_dict(zero3), 0)
    ds_teacher = estimate(spec_from_dict(zero3 | {"distill": {"teacher": str(tmp_path / "teacher")}}), 0)
    assert ds_teacher.teacher == 4 * teacher_cfg.num_params()
    assert ds_teacher.device_total - ds_plain.device_total == ds_teacher.teacher + 2 * 128 * 8192 * 4


def test_a_deepspeed_job_offloading_to_nvme_is_planned_with_its_states_on_disk():
    def offloaded(device):
        where = {"device": device} | ({"nvme_path": "/nvme"} if device == "nvme" else {})
        zero = {"stage": 3, "offload_optimizer": where, "offload_param": where}
        tree = {
            "name": "m",
            "model": {"preset": "1b"},
            "engine": "deepspeed",
            "deepspeed": {"config": {"zero_optimization": zero}},
            "parallel": {"dp": 4},
            "train": {"global_batch": 64, "micro_batch": 1, "seq_len": 2048, "precision": "bf16"},
            "data": {"path": "unused"},
        }
        return worst_rank(spec_from_dict(tree))

    cpu, nvme = offloaded("cpu"), offloaded("nvme")
    assert nvme.device_total == cpu.device_total and nvme.host + nvme.disk == cpu.host and nvme.disk > nvme.host > 0
    rows = [row for column in breakdown_table("t", nvme).columns[:1] for row in column._cells]
    assert "offloaded to NVMe (disk)" in rows and "offloaded to NVMe (disk)" not in [
        r for c in breakdown_table("t", cpu).columns[:1] for r in c._cells
    ]

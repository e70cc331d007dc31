"""The per-rank breakdown: pipeline in-flight counts, which rank is the worst, and
how layout choices move the figures the way they must."""

import pytest

from lmforge.memory.estimate import estimate, in_flight, worst_rank
from lmforge.spec import spec_from_dict


def job(**parallel):
    return spec_from_dict({
        "name": "m", "model": {"preset": "1b", "tie_embeddings": False}, "parallel": parallel,
        "train": {"global_batch": 64, "micro_batch": 1, "seq_len": 2048, "precision": "bf16"}, "data": {"path": "unused"},
    })


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


@pytest.mark.parametrize("parallel", [
    {"pp": 2, "dp": 2, "tp": 2, "zero": 3},
    {"pp": 1, "dp": 3, "tp": 1, "zero": 2},  # uneven FSDP chunks
    {"pp": 4, "dp": 1, "tp": 2, "zero": 0, "schedule": "interleaved-1f1b", "virtual_stages": 2},
])
def test_worst_rank_checks_one_rank_per_stage_yet_finds_the_maximum(parallel):
    spec = spec_from_dict({
        "name": "m", "model": {"preset": "small", "n_layers": 8}, "parallel": parallel,
        "train": {"global_batch": 24, "micro_batch": 1, "seq_len": 64}, "data": {"path": "unused"},
    })
    every = max((estimate(spec, rank) for rank in range(spec.world_size)), key=lambda b: b.device_total)
    assert worst_rank(spec).device_total == every.device_total

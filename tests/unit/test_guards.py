"""The guards' decisions on their own: non-finite steps in a row, loss spikes by
z-score, the smaller micro-batch an out-of-memory retry takes, and leaked tensors
found by their growth per step."""

import math
import pickle

import pytest
import torch

from lmforge.engines.base import StepStats
from lmforge.errors import Diverged
from lmforge.events import OutOfMemoryEvent, Rollback
from lmforge.guards.config import GuardSpec
from lmforge.guards.divergence import DivergenceGuard
from lmforge.guards.leaks import LeakCheck
from lmforge.guards.oom import with_smaller_micro_batch
from lmforge.spec import spec_from_dict


def finite(loss):
    return StepStats(loss=loss, grad_norm=1.0, lr=1e-3)


NAN = StepStats(loss=math.nan, grad_norm=math.nan, lr=1e-3, finite=False, update_skipped=True)


def test_nonfinite_steps_in_a_row_raise_and_a_finite_one_resets_the_count():
    guard = DivergenceGuard(GuardSpec(nonfinite_in_a_row=3))
    assert guard.observe(1, NAN)[0].in_a_row == 1
    guard.observe(2, finite(2.0))
    assert guard.observe(3, NAN)[0].in_a_row == 1 and guard.observe(4, NAN)[0].in_a_row == 2
    with pytest.raises(Diverged) as raised:
        guard.observe(5, NAN)
    assert raised.value.steps == [3, 4, 5] and "steps 3, 4, 5" in str(raised.value)


def test_a_spike_is_judged_against_the_window():
    guard = DivergenceGuard(GuardSpec(spike_window=10, spike_zscore=4.0))
    steady = [3.0 + 0.01 * (-1) ** i for i in range(10)]
    assert not any(guard.observe(i, finite(loss)) for i, loss in enumerate(steady, 1))
    assert not guard.observe(11, finite(3.03))  # noise: 3 standard deviations
    [spike] = guard.observe(12, finite(4.0))
    assert spike.event == "loss_spike" and spike.zscore > 4 and "loss spike 4.0000" in spike.line()
    assert not DivergenceGuard(GuardSpec()).observe(1, finite(100.0))  # no history yet: nothing to judge against


def test_a_spike_rolls_back_when_the_job_asks():
    guard = DivergenceGuard(GuardSpec(spike_window=10, spike_zscore=4.0, on_spike="rollback"))
    for step in range(1, 11):
        assert not guard.observe(step, finite(3.0 + 0.01 * (-1) ** step))
    with pytest.raises(Diverged) as err:
        guard.observe(11, finite(4.0))
    assert err.value.steps == [11] and str(err.value).startswith("loss spike at step 11: 4.0000,")
    restored = pickle.loads(pickle.dumps(err.value))  # it crosses from a rank to the controller
    assert restored.steps == [11] and str(restored) == str(err.value)


def job(**train):
    return spec_from_dict({"name": "g", "parallel": {"dp": 2}, "data": {"path": "unused"}, "train": {"global_batch": 24, "micro_batch": 6} | train})


def test_smaller_micro_batch_keeps_the_global_batch_whole():
    spec = job()
    assert with_smaller_micro_batch(spec).train.micro_batch == 3  # half
    assert with_smaller_micro_batch(job(micro_batch=3)).train.micro_batch == 1  # 24 % (1 x 2) == 0, and 3 // 2 = 1
    assert with_smaller_micro_batch(job(micro_batch=1)) is None
    floored = spec.with_changes("guards", oom_min_micro_batch=4)
    assert with_smaller_micro_batch(floored) is None
    odd = spec_from_dict({"name": "g", "parallel": {"dp": 1}, "data": {"path": "unused"}, "train": {"global_batch": 20, "micro_batch": 10}})
    assert with_smaller_micro_batch(odd).train.micro_batch == 5 and with_smaller_micro_batch(odd).grad_accum == 4


@pytest.mark.parametrize(
    "config",
    [
        {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4},  # micro-batch pinned by the config
        {"train_batch_size": 16, "gradient_accumulation_steps": 2},  # accumulation pinned, micro-batch derived
        {},  # both filled in from the job
    ],
)
def test_the_retry_moves_a_deepspeed_configs_micro_batch_and_accumulation_along(config):
    spec = spec_from_dict(
        {
            "name": "g",
            "engine": "deepspeed",
            "parallel": {"dp": 2},
            "data": {"path": "unused"},
            "train": {"global_batch": 16} | ({} if config else {"micro_batch": 4}),
            "deepspeed": {"config": config},
        }
    )
    assert spec.train.micro_batch == 4
    smaller = with_smaller_micro_batch(spec)
    assert smaller is not None and smaller.train.micro_batch == 2 and smaller.grad_accum == 4
    ds = smaller.deepspeed.config
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (2, 4, 16)


def test_leak_check_finds_what_grows_per_step():
    check, kept = LeakCheck(), []
    found = []
    for step in range(1, 13):
        kept.append(torch.zeros(3, 7, dtype=torch.float64))
        torch.ones(5)  # made and dropped every step: not a leak
        found += check.after_step(step)
    [leak] = [e for e in found if e.kind == "float64 [3, 7] on cpu"]
    assert leak.per_step == 1.0 and leak.bytes_per_step == 3 * 7 * 8
    assert not [e for e in found if "[5]" in e.kind]


def test_the_driver_keeps_the_job_as_the_guards_changed_it():
    """A replacement controller gets this job, not the one submitted."""
    from lmforge.cluster.driver import Seen

    seen = Seen(spec_from_dict({"name": "g", "parallel": {"dp": 2}, "data": {"path": "unused"}, "train": {"global_batch": 16, "micro_batch": 4}}))
    seen.add(Rollback(step=7, steps=[5, 6], rollback=1, max_rollbacks=2, skip_batches=[5, 6]), None)
    seen.add(OutOfMemoryEvent(step=8, rank=0, micro_batch=4, retry_micro_batch=2), None)
    seen.add(OutOfMemoryEvent(step=9, rank=0, micro_batch=2, retry_micro_batch=None), None)  # at the floor: the job fails, nothing changes
    assert seen.spec.guards.skip_batches == [5, 6] and seen.spec.train.micro_batch == 2 and seen.spec.grad_accum == 4
    handoff = seen.handoff(12)
    assert (handoff.failures, handoff.rollbacks, handoff.step) == (1, 1, 12)

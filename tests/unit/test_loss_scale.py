"""fp16's dynamic loss scale: halved (and the update skipped) when the gradients
overflow, doubled after clean steps, carried by checkpoints; in the native engine an
injected overflow skips one step without touching the weights, and the guard calls
it an overflow, not a divergence (fp16 across layouts: the parity tables)."""

import math

import pytest
import torch

from lmforge.engines.loss_scale import MIN_SCALE, LossScale
from lmforge.engines.native import NativeEngine
from lmforge.guards.divergence import DivergenceGuard
from lmforge.guards.inject import FaultInjector
from lmforge.parallel.mesh import build_mesh
from lmforge.parallel.shape import MeshShape
from lmforge.spec import spec_from_dict
from lmforge.trainer import job_loss


def test_halved_on_overflow_down_to_its_floor_and_doubled_after_clean_steps():
    scale = LossScale(scale=8.0, growth_interval=3)
    assert scale.update(float("inf")) and scale.scale == 4.0
    assert not scale.update(1.0) and not scale.update(1.0) and scale.scale == 4.0
    assert not scale.update(1.0) and scale.scale == 8.0  # the third clean step in a row
    assert scale.update(float("nan")) and scale.clean_steps == 0
    tiny = LossScale(scale=MIN_SCALE)
    tiny.update(float("inf"))
    assert tiny.scale == MIN_SCALE
    again = LossScale()
    again.load_state_dict(scale.state_dict())
    assert again.state_dict() == scale.state_dict() == {"scale": 4.0, "clean_steps": 0}


def engine(precision: str, overflow_at: list[int]):
    spec = spec_from_dict(
        {
            "name": "t",
            "data": {"path": "d"},
            "model": {"preset": "tiny", "vocab_size": 96, "n_layers": 2},
            "optim": {"lr": 1e-2, "warmup_steps": 1},
            "train": {"global_batch": 4, "micro_batch": 2, "seq_len": 16, "precision": precision},
            "debug": {"overflow_at_steps": overflow_at},
        }
    )
    built = NativeEngine(spec, build_mesh("cpu", MeshShape.for_spec(spec.parallel)), torch.device("cpu"), job_loss(spec, 96))
    return built, FaultInjector(spec, built, 0), DivergenceGuard(spec.guards)


def weights(built) -> dict:
    return {k: v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone() for k, v in built.parts[0].state_dict().items()}


def test_an_overflow_skips_its_step_and_halves_the_scale_without_a_divergence(one_rank):
    fp16, inject, guard = engine("fp16", [2])
    fp32, *_ = engine("fp32", [])
    tokens = torch.randint(0, 96, (3, 2, 2, 17), generator=torch.Generator().manual_seed(0))
    seen = []
    for step in (1, 2, 3):
        before = weights(fp16)
        inject.before_step(step)
        stats = fp16.train_step(tokens[step - 1])
        seen.append((stats, guard.observe(step, stats), _changed(before, weights(fp16))))
    reference = fp32.train_step(tokens[0]).loss  # the same first weights: fp16's numbers, close to fp32's
    assert seen[0][0].loss == pytest.approx(reference, rel=2e-2) and seen[0][0].loss != reference
    (first, none_1, moved_1), (second, events_2, moved_2), (third, none_3, moved_3) = seen
    assert (first.loss_scale, first.overflow, moved_1, none_1) == (2.0**16, False, True, [])
    assert second.overflow and not second.finite and math.isfinite(second.loss) and not moved_2  # skipped: the weights stay
    assert [type(e).__name__ for e in events_2] == ["Overflow"] and events_2[0].loss_scale == 2.0**16 and events_2[0].next_scale == 2.0**15
    assert guard.in_a_row == []  # no step towards a rollback
    assert (third.loss_scale, third.overflow, moved_3, none_3) == (2.0**15, False, True, [])
    _, plain = fp16.state_dict()
    assert plain["loss_scale"] == {"scale": 2.0**15, "clean_steps": 1}


def _changed(before: dict, after: dict) -> bool:
    return any(not torch.equal(before[k], after[k]) for k in before)

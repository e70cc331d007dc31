"""A loss mask is exact: what a step learns from an instruction sample depends on its
answer alone. Tokens and stored teacher targets at positions the mask leaves out
(the padding after each answer) can be anything: the step's loss, its terms and the
weights after it are the same; an answer token changed is seen."""

import pytest
import torch

from lmforge.distill.loss import DistillInputs
from lmforge.engines.native import NativeEngine
from lmforge.parallel.mesh import build_mesh
from lmforge.parallel.shape import MeshShape
from lmforge.spec import spec_from_dict
from lmforge.trainer import job_loss

SEQ, VOCAB, K = 16, 96, 4
PROMPTS, ANSWERS = [3, 5, 2, 6], [6, 4, 9, 5]  # per row: prompt tokens, answer tokens (then padding)
JOBS = {
    "cross-entropy": [],
    "cross-entropy + stored top-k": ["distill.teacher=t", "distill.cache=c", f"distill.top_k={K}", "distill.ce_weight=1", "distill.kd_weight=0.5"],
}


def loss_mask() -> torch.Tensor:
    """Position j learns token j + 1: from the prompt's last token to the answer's last."""
    mask = torch.zeros(4, SEQ, dtype=torch.bool)
    for row, (prompt, answer) in enumerate(zip(PROMPTS, ANSWERS)):
        mask[row, prompt - 1 : prompt + answer - 1] = True
    return mask


def padding() -> torch.Tensor:
    """The tokens after each answer: only masked positions read them or predict them."""
    where = torch.zeros(4, SEQ + 1, dtype=torch.bool)
    for row, (prompt, answer) in enumerate(zip(PROMPTS, ANSWERS)):
        where[row, prompt + answer :] = True
    return where


def step(overrides: list[str], tokens: torch.Tensor, targets) -> tuple[object, dict]:
    spec = spec_from_dict(
        {
            "name": "t",
            "data": {"path": "d"},
            "model": {"preset": "tiny", "vocab_size": VOCAB, "n_layers": 2},
            "optim": {"lr": 1e-2, "warmup_steps": 1},
            "train": {"global_batch": 4, "micro_batch": 2, "seq_len": SEQ},
        },
        overrides,
    )
    engine = NativeEngine(spec, build_mesh("cpu", MeshShape.for_spec(spec.parallel)), torch.device("cpu"), job_loss(spec, VOCAB))
    shape = (2, 2)
    cached = None if targets is None else tuple(t.view(*shape, SEQ, K) for t in targets)
    stats = engine.train_step(
        tokens.view(*shape, SEQ + 1), loss_mask=loss_mask().view(*shape, SEQ), loss_inputs=DistillInputs(cached=cached) if spec.distill else None
    )
    return stats, {k: v.clone() for k, v in engine.parts[0].state_dict().items()}


@pytest.mark.parametrize("job", JOBS)
def test_positions_outside_the_mask_change_nothing(one_rank, job):
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, VOCAB, (4, SEQ + 1), generator=gen)
    targets = None
    if "top-k" in job:
        ids = torch.stack([torch.randperm(VOCAB, generator=gen)[:K] for _ in range(4 * SEQ)]).view(4, SEQ, K)
        targets = (ids, torch.log_softmax(torch.randn(4, SEQ, K, generator=gen), -1).sort(-1, descending=True).values)
    base, weights = step(JOBS[job], tokens, targets)

    other = torch.where(padding(), torch.randint(1, VOCAB, (4, SEQ + 1), generator=gen), tokens)
    assert not torch.equal(other, tokens)
    other_targets = None
    if targets is not None:  # the stored soft targets of the masked positions, scrambled too
        unlearnt = ~loss_mask()
        other_targets = (
            torch.where(unlearnt[..., None], targets[0].flip(-1), targets[0]),
            torch.where(unlearnt[..., None], targets[1] - 1.0, targets[1]),
        )
    changed, changed_weights = step(JOBS[job], other, other_targets)
    assert changed.loss == pytest.approx(base.loss, rel=1e-6) and changed.grad_norm == pytest.approx(base.grad_norm, rel=1e-6)
    assert changed.terms == pytest.approx(base.terms, rel=1e-6)
    for name, value in weights.items():
        assert torch.allclose(changed_weights[name], value, rtol=1e-6, atol=1e-8), name

    answer = tokens.clone()
    answer[0, PROMPTS[0] + 1] = (answer[0, PROMPTS[0] + 1] + 1) % VOCAB  # an answer token: the mask learns it
    seen, _ = step(JOBS[job], answer, targets)
    assert seen.loss != pytest.approx(base.loss, rel=1e-4)

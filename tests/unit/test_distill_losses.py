"""Distillation losses against references written here in float64 probabilities (and
KL against `F.kl_div(log_target=True)`): every divergence at temperature 2, JSD at
beta 0, 0.1, 0.5, 0.9 and 1; masking (an all-masked batch gives 0, not NaN);
vocabulary slicing; chunking equal to one pass, gradients included; top-k targets
with a tail bucket (>= 0, never above the full KL, equal to it at k = V);
gradient-accumulation invariance of the 1/N normalization; hidden-state losses."""

import pytest
import torch
import torch.nn.functional as F

from lmforge.distill.hidden import HiddenAdapters, hidden_loss_sum
from lmforge.distill.losses import DIVERGENCES, Divergence, Mixture, TopK, kd_loss_sum

V, T = 50, 2.0


def logits(*shape, seed=0, scale=3.0):
    return torch.randn(*shape, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float() * scale


def kl(a, b):
    return (a * (a / b).log()).sum(-1)


def reference(div: Divergence, teacher, student, p=None):
    """D(p, q) per token from the definitions, in float64 probabilities (p: given, or
    the teacher logits' softmax)."""
    p = (teacher.double() / T).softmax(-1) if p is None else p
    q = (student.double() / T).softmax(-1)
    if div.name == "forward_kl" or (div.name == "jsd" and div.beta == 0):
        return kl(p, q)
    if div.name == "reverse_kl" or (div.name == "jsd" and div.beta == 1):
        return kl(q, p)
    if div.name == "jsd":
        m = div.beta * p + (1 - div.beta) * q
        return div.beta * kl(p, m) + (1 - div.beta) * kl(q, m)
    if div.name == "tvd":
        return 0.5 * (p - q).abs().sum(-1)
    if div.name == "skew_kl":
        return kl(p, div.skew * p + (1 - div.skew) * q)
    return kl(q, div.skew * q + (1 - div.skew) * p)


CASES = [Divergence(name) for name in DIVERGENCES if name != "jsd"] + [Divergence("jsd", beta=b) for b in (0, 0.1, 0.5, 0.9, 1)]
CASES += [Divergence("skew_kl", skew=0.5), Divergence("skew_reverse_kl", skew=0.3)]


@pytest.mark.parametrize("div", CASES, ids=lambda d: f"{d.name}-{d.beta}-{d.skew}")
def test_each_divergence_equals_its_definition(div):
    student, teacher = logits(2, 7, seed=1), logits(2, 7, seed=2)
    mask = torch.ones(2, 7)
    mask[1, 4:] = 0  # ignored positions
    got = kd_loss_sum(student, teacher, mask, div, T, V) / mask.sum()
    expected = T**2 * (reference(div, teacher, student) * mask).sum() / mask.sum()
    assert got.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("name", ["forward_kl", "reverse_kl", "jsd", "tvd"])
def test_several_teachers_are_mixed_in_probability_space(name):
    student, first, second = logits(2, 6, seed=20), logits(2, 6, seed=21), logits(2, 6, seed=22)
    mixed = 0.25 * (first.double() / T).softmax(-1) + 0.75 * (second.double() / T).softmax(-1)
    got = kd_loss_sum(student, Mixture([first, second], [0.25, 0.75]), None, Divergence(name), T, V)
    expected = T**2 * reference(Divergence(name), None, student, p=mixed).sum()
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)


def test_kl_equals_torchs_kl_div():
    student, teacher = logits(3, 5, seed=3), logits(3, 5, seed=4)
    log_p, log_q = (teacher / T).log_softmax(-1), (student / T).log_softmax(-1)
    forward = F.kl_div(log_q, log_p, log_target=True, reduction="sum")
    reverse = F.kl_div(log_p, log_q, log_target=True, reduction="sum")
    assert kd_loss_sum(student, teacher, None, Divergence("forward_kl"), T, V).item() == pytest.approx(T**2 * forward.item(), rel=1e-5)
    assert kd_loss_sum(student, teacher, None, Divergence("reverse_kl"), T, V).item() == pytest.approx(T**2 * reverse.item(), rel=1e-5)


@pytest.mark.parametrize("name", DIVERGENCES)
def test_an_all_masked_batch_gives_zero_and_finite_gradients(name):
    student = logits(2, 4, seed=5).requires_grad_()
    loss = kd_loss_sum(student, logits(2, 4, seed=6), torch.zeros(2, 4), Divergence(name), T, V, chunk_tokens=3)
    loss.backward()
    assert loss.item() == 0 and torch.isfinite(student.grad).all() and not student.grad.any()


def test_padded_vocabularies_are_sliced_to_the_tokenizers():
    student, teacher = logits(2, 6, seed=7), logits(2, 6, seed=8)
    padded_student = torch.cat([student, torch.full((2, 6, 8), 5.0)], dim=-1)  # phantom rows with real mass
    padded_teacher = torch.cat([teacher, torch.full((2, 6, 3), 9.0)], dim=-1)
    div = Divergence("jsd", beta=0.3)
    assert kd_loss_sum(padded_student, padded_teacher, None, div, T, V).item() == pytest.approx(
        kd_loss_sum(student, teacher, None, div, T, V).item(), rel=1e-6
    )


@pytest.mark.parametrize("name", DIVERGENCES)
def test_chunked_equals_one_pass_with_gradients(name):
    teacher = logits(3, 11, seed=9)
    mask = (torch.arange(33).reshape(3, 11) % 5 != 0).float()
    results = []
    for chunk in (None, 4):
        student = logits(3, 11, seed=10).requires_grad_()
        loss = kd_loss_sum(student, teacher, mask, Divergence(name, beta=0.4), T, V, chunk_tokens=chunk)
        loss.backward()
        results.append((loss.detach(), student.grad))
    assert (results[0][0] - results[1][0]).abs().item() < 1e-6 * max(1, results[0][0].abs().item())
    assert (results[0][1] - results[1][1]).abs().max().item() < 1e-6


def top_k(teacher, k):
    log_p = (teacher / T).log_softmax(-1)
    values, ids = log_p.topk(k, dim=-1)
    return TopK(ids, values)


@pytest.mark.parametrize("name", ["forward_kl", "reverse_kl"])
def test_top_k_with_a_tail_bucket_is_a_coarser_kl(name):
    """>= 0 without clamping, at most the full KL (coarsening never adds divergence),
    and the full KL itself at k = V."""
    student, teacher = logits(4, 9, seed=11), logits(4, 9, seed=12)
    div = Divergence(name)
    full = kd_loss_sum(student, teacher, None, div, T, V)
    previous = -1.0
    ulps = 4e-7 * full.item()  # a few fp32 roundings of the sums (at k = V the two are equal)
    for k in (1, 4, 16, 49):
        sparse = kd_loss_sum(student, top_k(teacher, k), None, div, T, V)
        assert 0 <= sparse.item() <= full.item() + ulps
        assert sparse.item() >= previous - ulps  # more categories, closer to the full KL
        previous = sparse.item()
    assert kd_loss_sum(student, top_k(teacher, V), None, div, T, V).item() == pytest.approx(full.item(), rel=1e-5)


def top_k_reference(student, targets):
    """Forward KL over the top k and a tail bucket, from its definition in float64
    probabilities, and its gradient by autograd."""
    student = student.detach().double().requires_grad_()
    q = (student / T).softmax(-1)
    p_top, q_top = targets.logprobs.double().exp(), q.gather(-1, targets.ids)
    p_tail, q_tail = 1 - p_top.sum(-1), 1 - q_top.sum(-1)
    loss = T**2 * ((p_top * (p_top / q_top).log()).sum(-1) + p_tail * (p_tail / q_tail).log()).sum()
    loss.backward()
    return loss.item(), student.grad.float()


def test_top_k_forward_kl_has_its_gradient_in_one_pass():
    """The fused top-k forward KL (loss and gradient written out together) against the
    definition: k < V through the tail bucket, k = V the full KL's (q - p) / T."""
    student, teacher = logits(3, 8, seed=40), logits(3, 8, seed=41)
    for k in (1, 4, 16, 49, V):
        grads = []
        for chunk in (None, 5):
            leaf = student.clone().requires_grad_()
            loss = kd_loss_sum(leaf, top_k(teacher, k), None, Divergence("forward_kl"), T, V, chunk_tokens=chunk)
            loss.backward()
            grads.append(leaf.grad)
        if k < V:
            want_loss, want_grad = top_k_reference(student, top_k(teacher, k))
        else:
            want_loss = kd_loss_sum(student, teacher, None, Divergence("forward_kl"), T, V).item()
            want_grad = T * ((student / T).softmax(-1) - (teacher / T).softmax(-1))
        assert loss.item() == pytest.approx(want_loss, rel=1e-5, abs=1e-6), k
        assert all((g - want_grad).abs().max().item() < 1e-6 for g in grads), k


def test_gradient_accumulation_gives_the_same_loss_and_gradients():
    """GA 1 x micro 8, GA 8 x micro 1, and dp 2 x GA 4 (each rank dividing by its share
    of the global N, the ranks' gradients then averaged, as FSDP and ZeRO do): equal,
    although the samples hold different numbers of unmasked tokens."""
    gen = torch.Generator().manual_seed(13)
    hidden, teacher = torch.randn(8, 6, 16, generator=gen), logits(8, 6, seed=14)
    mask = (torch.rand(8, 6, generator=gen) > 0.4).float()
    weight = torch.randn(V, 16, generator=gen)

    def train(dp: int, micro: int) -> tuple[float, torch.Tensor]:
        total, grads = 0.0, []
        for rank in range(dp):
            head = torch.nn.Parameter(weight.clone())
            for start in range(rank * 8 // dp, (rank + 1) * 8 // dp, micro):
                part = slice(start, start + micro)
                loss = kd_loss_sum(hidden[part] @ head.T, teacher[part], mask[part], Divergence("jsd", beta=0.5), T, V) / (mask.sum() / dp)
                loss.backward()
                total += loss.item() / dp
            grads.append(head.grad)
        return total, torch.stack(grads).mean(dim=0)

    want = train(1, 8)
    for dp, micro in ((1, 1), (2, 1)):
        got = train(dp, micro)
        assert got[0] == pytest.approx(want[0], rel=1e-5)
        assert (got[1] - want[1]).abs().max().item() < 1e-5


def test_hidden_losses_and_identity_adapters():
    gen = torch.Generator().manual_seed(15)
    student = [torch.randn(2, 5, 8, generator=gen), torch.randn(2, 5, 8, generator=gen)]
    teacher = [torch.randn(2, 5, 8, generator=gen), torch.randn(2, 5, 8, generator=gen)]
    mask = torch.ones(2, 5)
    mask[0, 3:] = 0
    adapters = HiddenAdapters({0: 2, 1: 3}, 8, 8)
    assert all(torch.equal(a.weight, torch.eye(8)) for a in adapters.adapters.values())
    adapted = adapters(*student)
    mse = hidden_loss_sum(adapted, teacher, mask, "mse")
    expected = sum((((s - t) ** 2).mean(-1) * mask).sum() for s, t in zip(student, teacher))
    assert mse.item() == pytest.approx(expected.item(), rel=1e-6)
    cosine = hidden_loss_sum(adapted, teacher, mask, "cosine")
    cos = lambda a, b: (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
    expected = sum(((1 - cos(s, t)) * mask).sum() for s, t in zip(student, teacher))
    assert cosine.item() == pytest.approx(expected.item(), rel=1e-5)
    wider = HiddenAdapters({0: 2}, 8, 12, seed=3)  # another width: a learned projection, not the identity
    assert wider.adapters["0"].weight.shape == (12, 8)
    assert torch.equal(wider.adapters["0"].weight, HiddenAdapters({0: 2}, 8, 12, seed=3).adapters["0"].weight)
    assert hidden_loss_sum(wider(student[0]), [torch.randn(2, 5, 12)], torch.zeros(2, 5), "mse").item() == 0


def test_the_compiled_forward_kl_equals_the_eager_one():
    """`parallel.compile` compiles the fused forward KL (loss and gradient in one pass)."""
    teacher = logits(2, 9, seed=30)
    results = []
    for compiled in (False, True):
        student = logits(2, 9, seed=31).requires_grad_()
        loss = kd_loss_sum(student, teacher, torch.ones(2, 9), Divergence("forward_kl"), T, V, chunk_tokens=6, compiled=compiled)
        loss.backward()
        results.append((loss.item(), student.grad))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-6)
    assert (results[1][1] - results[0][1]).abs().max().item() < 1e-6

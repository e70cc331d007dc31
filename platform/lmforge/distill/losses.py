"""Distillation losses between a teacher's and a student's next-token distributions.

Both sides become fp32 log-probabilities at temperature T over the same categories:
the tokenizer's vocabulary (dense teacher logits), or a teacher's top-k tokens plus
one tail bucket holding the rest of the mass (sparse targets, as the offline cache
stores them). Every divergence is a sum over categories of an elementwise term,
so a vocabulary sharded over tensor-parallel ranks needs only two all-reduces of
the softmax's max and sum-exp and one of each token's partial sum. The caller
divides the returned sum by N, the unmasked tokens of the whole global batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.utils.checkpoint import checkpoint

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd", "tvd", "skew_kl", "skew_reverse_kl")
# log(0) stands in as this: finite, so 0 * (log 0 - x) is 0 and never NaN (a tail
# bucket that holds nothing, a student that puts no mass there).
LOG_ZERO = math.log(1e-30)
# A padded vocabulary row's logit in a TP shard: no probability, yet finite, so that
# 0 * (its log-ratio) stays 0.
PADDED_LOGIT = -1e30


@dataclass(frozen=True)
class Divergence:
    name: str = "forward_kl"
    beta: float = 0.5  # jsd: the teacher's share of the mixture M
    skew: float = 0.1  # skew_kl / skew_reverse_kl: the share of the first distribution in the mixture

    def __post_init__(self):
        if self.name not in DIVERGENCES:
            raise ValueError(f"unknown divergence {self.name!r}; choose one of {', '.join(DIVERGENCES)}")


def _mixture(log_a: torch.Tensor, log_b: torch.Tensor, share_a: float) -> torch.Tensor:
    """log(share_a * a + (1 - share_a) * b), by logsumexp: never mixed in log space."""
    return torch.logaddexp(log_a + math.log(share_a), log_b + math.log1p(-share_a))


def _kl_terms(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) before its sum over categories."""
    return log_a.exp() * (log_a - log_b)


def divergence_terms(log_p: torch.Tensor, log_q: torch.Tensor, div: Divergence) -> torch.Tensor:
    """Elementwise terms whose sum over the last dim is D(p, q); p the teacher, q the student."""
    if div.name == "forward_kl" or (div.name == "jsd" and div.beta == 0):
        return _kl_terms(log_p, log_q)
    if div.name == "reverse_kl" or (div.name == "jsd" and div.beta == 1):
        return _kl_terms(log_q, log_p)
    if div.name == "jsd":
        log_m = _mixture(log_p, log_q, div.beta)
        return div.beta * _kl_terms(log_p, log_m) + (1 - div.beta) * _kl_terms(log_q, log_m)
    if div.name == "tvd":
        return 0.5 * (log_p.exp() - log_q.exp()).abs()
    if div.name == "skew_kl":
        return _kl_terms(log_p, _mixture(log_p, log_q, div.skew))
    return _kl_terms(log_q, _mixture(log_q, log_p, div.skew))  # skew_reverse_kl


class SumOfShares(torch.autograd.Function):
    """The sum of every TP rank's share, which each rank then uses alike: forward an
    all-reduce, backward the gradient as it is, since each rank's share reaches the
    loss once, through this sum (Megatron's reduce from the tensor-parallel region;
    a plain differentiable all-reduce would count it once per rank)."""

    @staticmethod
    def forward(ctx, share: torch.Tensor, group) -> torch.Tensor:
        total = share.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def within_vocab(logits: torch.Tensor, vocab: int, tp_group=None) -> torch.Tensor:
    """The logits over the tokenizer's real vocabulary: the rows a model pads it with
    sliced off or, in a vocabulary shard under TP, given no probability (fp32, as
    `log_softmax` would make them)."""
    if tp_group is None:  # a slice only where there is padding: its backward is a vocabulary-wide copy
        return logits if logits.shape[-1] <= vocab else logits[..., :vocab]
    width = logits.shape[-1]
    start = dist.get_rank(tp_group) * width
    if start + width <= vocab:
        return logits
    padded = torch.arange(start, start + width, device=logits.device) >= vocab
    return logits.float().masked_fill(padded, PADDED_LOGIT)


def log_softmax(logits: torch.Tensor, tp_group=None) -> torch.Tensor:
    """fp32 log-softmax over the last dim; with `tp_group`, that dim is this rank's
    shard of the vocabulary and the normalizer is the whole vocabulary's."""
    logits = logits.float()
    if tp_group is None:
        return logits.log_softmax(dim=-1)
    # The max only shifts for stability: no gradient flows through it. The sum-exp's
    # gradient must reach every rank's shard from every rank's use of it: a summing backward.
    top = funcol.all_reduce(logits.detach().amax(dim=-1, keepdim=True), "max", tp_group)
    sum_exp = funcol.all_reduce((logits - top).exp().sum(dim=-1, keepdim=True), "sum", tp_group)
    return logits - top - sum_exp.log()


def with_tail(log_top: torch.Tensor) -> torch.Tensor:
    """Top-k log-probabilities plus a last bucket holding the rest of the mass, so the
    k + 1 categories are a distribution and a KL over them is >= 0."""
    log_top = log_top.clamp(min=LOG_ZERO)
    held = torch.logsumexp(log_top, dim=-1, keepdim=True).clamp(max=0)
    tail = (-torch.expm1(held)).clamp(min=math.exp(LOG_ZERO)).log()
    return torch.cat([log_top, tail], dim=-1)


@dataclass
class TopK:
    """A teacher's sparse targets per token: top-k ids and log-probabilities at the
    distillation temperature; `aligned`, where a teacher of another tokenizer has a
    target at all (`distill/cross_tokenizer.py`): the positions without one learn nothing from it."""

    ids: torch.Tensor  # (..., k) int64
    logprobs: torch.Tensor  # (..., k) float
    aligned: Optional[torch.Tensor] = None  # (...) bool; None: every position

    def __len__(self) -> int:
        return len(self.ids)

    def rows(self, index) -> "TopK":
        return TopK(self.ids[index], self.logprobs[index], None if self.aligned is None else self.aligned[index])

    def flat(self) -> "TopK":
        return TopK(self.ids.flatten(0, -2), self.logprobs.flatten(0, -2), None if self.aligned is None else self.aligned.flatten())

    def where_aligned(self, weights: torch.Tensor) -> torch.Tensor:
        """Per-position weights, zero where the teacher has no target."""
        return weights if self.aligned is None else weights * self.aligned.reshape(weights.shape).to(weights.dtype)


def stored_top_k(ids: torch.Tensor, logprobs: torch.Tensor) -> TopK:
    """Top-k targets as a cache stores them: where a teacher of another tokenizer has no
    target, the ids are -1."""
    return TopK(ids.clamp(min=0), logprobs, ids[..., 0] >= 0)


@dataclass
class Mixture:
    """Several teachers' logits, their distributions mixed in probability space with
    these weights (summing to 1)."""

    logits: list[torch.Tensor]
    weights: list[float]

    def __len__(self) -> int:
        return len(self.logits[0])

    def rows(self, index) -> "Mixture":
        return Mixture([t[index] for t in self.logits], self.weights)

    def flat(self) -> "Mixture":
        return Mixture([t.flatten(0, -2) for t in self.logits], self.weights)


def log_probs_at(log_q: torch.Tensor, ids: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Log-probabilities of the given token ids. With `tp_group`, `log_q` is this rank's
    vocabulary shard: each id's comes from the rank holding it, summed over the group."""
    if tp_group is None:
        return log_q.gather(-1, ids)
    width = log_q.shape[-1]
    local = ids - dist.get_rank(tp_group) * width
    held = (local >= 0) & (local < width)
    share = torch.where(held, log_q.gather(-1, local.clamp(0, width - 1)), 0.0)
    return SumOfShares.apply(share, tp_group)


def top_k(log_p: torch.Tensor, k: int, tp_group=None) -> TopK:
    """The k most likely tokens, most likely first. With `tp_group`, `log_p` is this
    rank's vocabulary shard: each rank's best k (as whole-vocabulary ids) are gathered
    and the best k of those kept."""
    values, ids = log_p.topk(min(k, log_p.shape[-1]), dim=-1)
    if tp_group is None:
        return TopK(ids, values)
    ids = ids + dist.get_rank(tp_group) * log_p.shape[-1]
    size = dist.get_world_size(tp_group)
    every = [[torch.empty_like(t) for _ in range(size)] for t in (values, ids)]
    dist.all_gather(every[0], values.contiguous(), group=tp_group)
    dist.all_gather(every[1], ids.contiguous(), group=tp_group)
    values, best = torch.cat(every[0], dim=-1).topk(k, dim=-1)
    return TopK(torch.cat(every[1], dim=-1).gather(-1, best), values)


def teacher_log_probs(teacher, temperature: float, vocab: int, tp_group=None) -> torch.Tensor:
    """fp32 log-probabilities at the temperature of dense logits or a `Mixture` (the
    weighted sum of the teachers' probabilities, taken by logsumexp)."""
    if isinstance(teacher, torch.Tensor):
        teacher = Mixture([teacher], [1.0])
    parts = [log_softmax(within_vocab(t.detach(), vocab, tp_group) / temperature, tp_group) for t in teacher.logits]
    if len(parts) == 1:
        return parts[0]
    weighted = torch.stack([part + math.log(weight) for part, weight in zip(parts, teacher.weights)])
    return torch.logsumexp(weighted, dim=0)


def token_divergence(student_logits: torch.Tensor, teacher, div: Divergence, temperature: float, vocab: int, tp_group=None) -> torch.Tensor:
    """D(teacher, student) per token (shape: the logits' without the last dim).
    `teacher`: dense logits of the student's shape, a `Mixture` of them, or `TopK`; `vocab`: the
    tokenizer's real size (rows beyond it, a model's padding, are dropped first)."""
    log_q = log_softmax(within_vocab(student_logits, vocab, tp_group) / temperature, tp_group)
    if isinstance(teacher, TopK):  # k + 1 categories, the same on every TP rank
        log_p = with_tail(teacher.logprobs.float())
        log_q = with_tail(log_probs_at(log_q, teacher.ids, tp_group))
        return divergence_terms(log_p, log_q, div).sum(dim=-1)
    log_p = teacher_log_probs(teacher, temperature, vocab, tp_group)
    per_token = divergence_terms(log_p, log_q, div).sum(dim=-1)
    return per_token if tp_group is None else SumOfShares.apply(per_token, tp_group)


def _softmax(logits: torch.Tensor, tp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities over the last dim, the log of their normalizer per row), each
    element's exp taken once. With `tp_group`, that dim is this rank's vocabulary shard
    and the normalizer the whole vocabulary's."""
    if tp_group is None:
        probs = logits.softmax(dim=-1)
        # The largest probability is exp(max - lse), computed as 1 / sum-exp: its log gives lse back exactly.
        return probs, logits.amax(dim=-1) - probs.amax(dim=-1).log()
    top = logits.amax(dim=-1, keepdim=True)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp_group)
    probs = (logits - top).exp_()
    sum_exp = probs.sum(dim=-1, keepdim=True)
    dist.all_reduce(sum_exp, group=tp_group)
    return probs.div_(sum_exp), (top + sum_exp.log()).squeeze(-1)


def _forward_kl_and_grad(student: torch.Tensor, teacher: torch.Tensor, weights: torch.Tensor, temperature: float, tp_group, need_grad: bool):
    """(the weighted sum over the rows of this shard's part of KL(p || q), q - p: its
    gradient with respect to the student's logits before each row's weight / T).
    `teacher`: its logits divided by T (fp32). With a those, s = student / T and log A,
    log S their softmax normalizers, KL(p || q) = sum_v p (a - s) - log A + log S: one
    exp per element on each side, as many as cross-entropy's forward and backward take.
    In place where it can be: on a CPU a fresh vocabulary-wide buffer costs a pass."""
    p, teacher_lse = _softmax(teacher, tp_group)
    scaled = student.float() * (1 / temperature)
    q, student_lse = _softmax(scaled, tp_group)
    per_row = torch.linalg.vecdot(p, torch.sub(teacher, scaled, out=scaled))
    if tp_group is None or dist.get_rank(tp_group) == 0:  # the normalizers once, not once per shard
        per_row = per_row + (student_lse - teacher_lse)
    loss = (per_row * weights).sum()
    return loss, q.sub_(p) if need_grad else None


def _top_k_kl_and_grad(student: torch.Tensor, targets: TopK, weights: torch.Tensor, temperature: float, tp_group, need_grad: bool):
    """(the weighted sum over the rows of KL(p || q) over the teacher's top k and a tail
    bucket, as `with_tail` makes them, its gradient with respect to this shard's
    student logits before each row's weight / T). With P the teacher's mass on its top k, p_t its tail, q_t the
    student's tail and r = p_t / q_t, the gradient of a row is, over T,
    q_j (P + p_t - r) + [j in top k] (r q_j - p_j); where `with_tail` clamps the
    student's tail (no mass left to it) that term has no gradient: q_j P - [j in top k] p_j."""
    log_q = log_softmax(student.float() * (1 / temperature), tp_group)
    with torch.no_grad():  # the gather's TP sum is only a value here: the gradient is written out below
        log_q_top = log_probs_at(log_q, targets.ids, tp_group)
    log_p, log_q_tailed = with_tail(targets.logprobs.float()), with_tail(log_q_top)
    p = log_p.exp()
    loss = ((p * (log_p - log_q_tailed)).sum(dim=-1) * weights).sum()
    if not need_grad:
        return loss, None
    p_top, p_tail = p[:, :-1], p[:, -1:]
    held = torch.logsumexp(log_q_top, dim=-1, keepdim=True)
    free = ((held < 0) & (-torch.expm1(held) > math.exp(LOG_ZERO))).float()  # with_tail's tail clamps inactive
    ratio = free * (log_p[:, -1:] - log_q_tailed[:, -1:]).exp()
    grad = log_q.exp_().mul_(p_top.sum(dim=-1, keepdim=True) + free * p_tail - ratio)
    at_top = ratio * log_q_top.exp() - p_top
    local = targets.ids
    if tp_group is not None:  # this shard's ids only; the others add nothing
        local = targets.ids - dist.get_rank(tp_group) * log_q.shape[-1]
        held_here = (local >= 0) & (local < log_q.shape[-1])
        local, at_top = local.clamp(0, log_q.shape[-1] - 1), torch.where(held_here, at_top, 0.0)
    return loss, grad.scatter_add_(-1, local, at_top)


_COMPILED: dict = {}


def _kernel(kernel, compiled: bool, tp_group):
    """The eager function, or one inductor kernel of its passes (a vocabulary-sharded
    one stays eager: its normalizer needs collectives)."""
    if not compiled or tp_group is not None:
        return kernel
    if kernel not in _COMPILED:
        _COMPILED[kernel] = torch.compile(kernel, dynamic=None)
    return _COMPILED[kernel]


class _WithItsGradient(torch.autograd.Function):
    """A loss summed over a chunk's tokens whose gradient with respect to the student's
    logits `kernel` computes in the same pass, as cross-entropy's is: no
    log-probabilities kept for the backward, none recomputed. The kernel leaves out each
    row's factor weight / T, which the backward applies with the incoming gradient in
    one pass. Under TP the gradient of this rank's shard is the same formula, the
    softmax's normalizer being the whole vocabulary's."""

    @staticmethod
    def forward(ctx, student: torch.Tensor, kernel, targets, weights: torch.Tensor, temperature: float, tp_group, compiled: bool) -> torch.Tensor:
        need_grad = ctx.needs_input_grad[0]  # not when evaluating
        loss, grad = _kernel(kernel, compiled, tp_group)(student, targets, weights, temperature, tp_group, need_grad)
        if need_grad:
            ctx.save_for_backward(grad.to(student.dtype), weights * (1 / temperature))
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        student_grad, row_scale = ctx.saved_tensors
        # In place: a saved gradient is used once (no backward here retains the graph).
        return student_grad.mul_((row_scale * grad)[:, None]), None, None, None, None, None, None


def _fused_forward_kl(
    student: torch.Tensor, teacher, weights: torch.Tensor, temperature: float, vocab: int, tp_group, compiled: bool
) -> torch.Tensor:
    student = within_vocab(student, vocab, tp_group)
    if isinstance(teacher, TopK):  # k + 1 categories, the same on every TP rank: the loss is too
        # Eager even with parallel.compile: inductor's kernel of it measured slower on a CPU (bench/distill.py).
        return _WithItsGradient.apply(student, _top_k_kl_and_grad, teacher, weights, temperature, tp_group, False)
    if isinstance(teacher, Mixture):  # its log-probabilities are logits whose normalizer is 1
        scaled_teacher = teacher_log_probs(teacher, temperature, vocab, tp_group)
    else:
        scaled_teacher = within_vocab(teacher.detach(), vocab, tp_group).float() * (1 / temperature)
    partial = _WithItsGradient.apply(student, _forward_kl_and_grad, scaled_teacher, weights, temperature, tp_group, compiled)
    return partial if tp_group is None else SumOfShares.apply(partial, tp_group)


def _chunks(rows, size: int):
    """The rows in chunks of `size`: a split, not one slice each (a slice's backward is a
    zeroed gradient of the whole input), and the rows themselves when one chunk holds
    them (a split's backward would copy them)."""
    count = len(rows)
    if size >= count:
        return [rows]
    if isinstance(rows, torch.Tensor):
        return rows.split(size)
    return [rows.rows(slice(start, start + size)) for start in range(0, count, size)]


def kd_loss_sum(
    student_logits: torch.Tensor,
    teacher,
    mask: Optional[torch.Tensor],
    div: Divergence,
    temperature: float,
    vocab: int,
    tp_group=None,
    chunk_tokens: Optional[int] = None,
    compiled: bool = False,
) -> torch.Tensor:
    """T^2 * sum over unmasked tokens of D(teacher, student): the caller divides by N.

    With `chunk_tokens`, tokens go through in chunks whose fp32 log-probabilities are
    recomputed in the backward instead of kept, so no more than one chunk's are ever
    alive for both sides at once. Forward KL (dense or top-k targets) needs neither: its
    gradient is computed with it, chunk by chunk, in the student's dtype (`compiled`:
    in one inductor kernel)."""
    flat_student = student_logits.flatten(0, -2)
    flat_teacher = teacher.flatten(0, -2) if isinstance(teacher, torch.Tensor) else teacher.flat()
    tokens = flat_student.shape[0]
    weights = torch.ones(tokens, device=flat_student.device) if mask is None else mask.flatten().float()
    if isinstance(flat_teacher, TopK):
        weights = flat_teacher.where_aligned(weights)
    size = min(chunk_tokens or tokens, tokens) or 1
    # Forward KL has a closed-form gradient, on dense or top-k targets: one fused pass, as cross-entropy.
    fused = div.name == "forward_kl" or (div.name == "jsd" and div.beta == 0)
    # One chunk holds no more than a chunk's worth: nothing to save by recomputing it.
    recompute = size < tokens and torch.is_grad_enabled() and not fused

    def compute(s, t, w):
        if fused:
            return _fused_forward_kl(s, t, w, temperature, vocab, tp_group, compiled)
        return (token_divergence(s, t, div, temperature, vocab, tp_group) * w).sum()

    total = torch.zeros((), device=flat_student.device)
    for args in zip(_chunks(flat_student, size), _chunks(flat_teacher, size), _chunks(weights, size)):
        total = total + (checkpoint(compute, *args, use_reentrant=False) if recompute else compute(*args))
    return temperature**2 * total

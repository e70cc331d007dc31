"""The KD loss on a vocabulary sharded over two tensor-parallel ranks (real gloo
process groups): loss and the gradients of each rank's logit shard equal one
process's on the whole vocabulary within 1e-5, for every divergence and for two
teachers mixed, chunked; with top-k targets, the teacher's k best found over the
shards; and with a tokenizer smaller than the models' padded vocabulary, the padded
rows given no probability in the last shard as one process slices them off."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from lmforge.distill.losses import DIVERGENCES, Divergence, Mixture, kd_loss_sum, teacher_log_probs, top_k
from ports import free_port

V, T, WORLD, K = 48, 1.5, 2, 6


def inputs():
    gen = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 5, V, generator=gen) * 3, torch.randn(2, 5, V, generator=gen) * 3
    mask = torch.ones(2, 5)
    mask[1, 3:] = 0
    return student, teacher, mask


def mixture(teacher, shard=slice(None)):
    """Two teachers, mixed 3:7."""
    return Mixture([teacher[..., shard], (0.5 * teacher + 1)[..., shard]], [0.3, 0.7])


CASES = [*DIVERGENCES, "jsd-mixture", "jsd-topk", "forward_kl-topk", "jsd-padded", "forward_kl-padded", "jsd-topk-padded", "forward_kl-topk-padded"]


def vocab(name: str) -> int:
    """The tokenizer's vocabulary: the last 5 rows of the padded cases are padding."""
    return V - 5 if name.endswith("padded") else V


def targets(name: str, teacher, shard=slice(None), tp_group=None):
    """A case's teacher: dense logits (this rank's shard), two mixed, or their top-k."""
    if name.endswith("mixture"):
        return mixture(teacher, shard)
    if "-topk" in name:
        return top_k(teacher_log_probs(teacher[..., shard], T, vocab(name), tp_group), K, tp_group)
    return teacher[..., shard]


def divergence(name: str) -> Divergence:
    return Divergence(name.partition("-")[0], beta=0.3)


def whole_vocabulary(name: str):
    student, teacher, mask = inputs()
    student.requires_grad_()
    loss = kd_loss_sum(student, targets(name, teacher), mask, divergence(name), T, vocab(name)) / mask.sum()
    loss.backward()
    return loss.item(), student.grad


def sharded(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        student, teacher, mask = inputs()
        shard = slice(rank * V // WORLD, (rank + 1) * V // WORLD)
        for name in CASES:
            local = student[..., shard].clone().requires_grad_()
            group = dist.group.WORLD
            loss = (
                kd_loss_sum(local, targets(name, teacher, shard, group), mask, divergence(name), T, vocab(name), tp_group=group, chunk_tokens=4)
                / mask.sum()
            )
            loss.backward()
            results[(rank, name)] = (loss.item(), local.grad)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_results():
    port = free_port()
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        procs = [ctx.Process(target=sharded, args=(rank, port, results)) for rank in range(WORLD)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout=120)
        assert all(proc.exitcode == 0 for proc in procs), [proc.exitcode for proc in procs]
        return dict(results)


@pytest.mark.parametrize("name", CASES)
def test_tensor_parallel_kd_equals_one_process(tp_results, name):
    loss, grad = whole_vocabulary(name)
    for rank in range(WORLD):
        got, local_grad = tp_results[(rank, name)]
        assert got == pytest.approx(loss, rel=1e-5, abs=1e-7)
        want = grad[..., rank * V // WORLD : (rank + 1) * V // WORLD]
        assert (local_grad - want).abs().max().item() < 1e-5

"""Which rank a hang is blamed on, from every rank's process state and stack (the
stacks of a real hang: tests/chaos, the stopped rank)."""

from lmforge.cluster.hang import RankStack, behind

IN_ALLREDUCE = """Thread 7 (idle): "MainThread"
    all_reduce (torch/distributed/distributed_c10d.py:2950)
    train_step (lmforge/engines/native.py:177)
    run (lmforge/trainer.py:175)
"""
READING = """Thread 7 (idle): "MainThread"
    read (lmforge/data/feed.py:120)
    run (lmforge/trainer.py:168)
"""


def rank(r: int, state: str, stack: str) -> RankStack:
    return RankStack(rank=r, pid=100 + r, state=state, stack=stack)


def test_a_stopped_rank_is_behind_wherever_it_stopped():
    stacks = [rank(0, "S (sleeping)", IN_ALLREDUCE), rank(1, "T (stopped)", IN_ALLREDUCE), rank(2, "S (sleeping)", IN_ALLREDUCE)]
    assert behind(stacks) is stacks[1]
    assert stacks[1].doing() == "pid 101, stopped by a signal, in all_reduce (torch/distributed/distributed_c10d.py:2950)"


def test_else_the_one_rank_not_waiting_on_its_peers():
    stacks = [rank(0, "S (sleeping)", IN_ALLREDUCE), rank(1, "S (sleeping)", READING)]
    assert behind(stacks) is stacks[1]
    assert stacks[1].doing() == "pid 101, sleeping, in read (lmforge/data/feed.py:120)"


def test_no_one_is_blamed_where_no_single_rank_stands_out():
    assert behind([rank(0, "S (sleeping)", IN_ALLREDUCE), rank(1, "S (sleeping)", IN_ALLREDUCE)]) is None
    assert behind([rank(0, "R (running)", READING), rank(1, "R (running)", READING)]) is None
    assert behind([rank(0, "T (stopped)", READING), rank(1, "T (stopped)", READING)]) is None

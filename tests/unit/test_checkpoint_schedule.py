"""When ranks save: every `checkpoint.interval` steps and at the last, and with
`checkpoint.every_minutes` also when rank 0's clock says so, whichever comes first
(a 2-rank job saving by the clock runs in test_remote_jobs)."""

from lmforge.checkpoint.config import CheckpointSpec
from lmforge.checkpoint.schedule import CheckpointSchedule


class Clock:
    def __init__(self, step_s: float):
        self.now, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        return self.now


def saves(schedule: CheckpointSchedule, clock: Clock, steps: int) -> list[int]:
    due = []
    for step in range(1, steps + 1):
        clock.now += clock.step_s
        if schedule.due(step):
            due.append(step)
    return due


def test_by_steps_alone_nothing_is_asked_of_rank_0():
    asked = []
    schedule = CheckpointSchedule(CheckpointSpec(interval=4), 10, lambda flag: asked.append(flag) or flag, Clock(60))
    assert saves(schedule, schedule.clock, 10) == [4, 8, 10] and asked == []


def test_the_clock_or_the_interval_whichever_comes_first_each_restarting_the_clock():
    clock = Clock(25)  # a step takes 25 s; a save is due after 60 s without one
    schedule = CheckpointSchedule(CheckpointSpec(interval=10, every_minutes=1), 20, lambda flag: flag, clock)
    assert saves(schedule, clock, 20) == [3, 6, 9, 10, 13, 16, 19, 20]


def test_every_rank_takes_rank_0s_word():
    clock = Clock(25)
    late_here = CheckpointSchedule(CheckpointSpec(interval=10, every_minutes=1), 20, lambda flag: False, clock)
    assert saves(late_here, clock, 6) == []  # this rank's clock is late, rank 0's is not
    clock = Clock(1)
    early_here = CheckpointSchedule(CheckpointSpec(interval=10, every_minutes=1), 20, lambda flag: True, clock)
    assert saves(early_here, clock, 3) == [1, 2, 3]  # rank 0's clock is late, this one's is not

"""When the ranks save a checkpoint: every `checkpoint.interval` steps, at the last
step, and with `checkpoint.every_minutes` also once that long has passed since the
last save, whichever comes first. The clock is rank 0's; all ranks take its word
(one small broadcast a step), so every rank saves at the same step."""

from __future__ import annotations

import time
from typing import Callable, Optional

from lmforge.checkpoint.config import CheckpointSpec


class CheckpointSchedule:
    def __init__(
        self,
        spec: CheckpointSpec,
        max_steps: int,
        rank0_says: Callable[[bool], bool],
        clock: Callable[[], float] = time.monotonic,
    ):
        """`rank0_says(flag)`: rank 0's flag on every rank (a collective, called by all
        ranks at every step when the clock counts)."""
        self.interval, self.max_steps = spec.interval, max_steps
        self.every_s: Optional[float] = spec.every_minutes * 60 if spec.every_minutes else None
        self.rank0_says, self.clock = rank0_says, clock
        self.last_save = clock()

    def due(self, step: int) -> bool:
        due = step % self.interval == 0 or step == self.max_steps
        if self.every_s is not None:
            due = self.rank0_says(due or self.clock() - self.last_save >= self.every_s)
        if due:
            self.last_save = self.clock()
        return due

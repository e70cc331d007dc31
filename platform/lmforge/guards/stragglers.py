"""Which rank keeps the others waiting. Each rank times what it does between two
steps of training (its batch, checkpoint staging, evaluation, anything else outside
the step's collectives); the times are gathered every step, and the slowest rank's
peers wait that much longer in the step's first collective."""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist


class StragglerWatch:
    """`group`: a gloo group of the whole job (None at one rank: no report)."""

    def __init__(self, group: Optional[dist.ProcessGroup], world: int):
        self.group, self.world = group, world
        self._last_done = time.perf_counter()
        self._between = 0.0

    def begin(self) -> None:
        """The training loop starts: the first step's time between counts from here."""
        self._last_done = time.perf_counter()

    def ready(self) -> None:
        """The rank is about to train its step: what it did since its last counts."""
        self._between = time.perf_counter() - self._last_done

    def done(self) -> dict:
        """After the step (a collective on every rank): the Step row's straggler fields."""
        self._last_done = time.perf_counter()
        if self.group is None:
            return {}
        mine = torch.tensor([self._between], dtype=torch.float64)
        everyone = [torch.zeros(1, dtype=torch.float64) for _ in range(self.world)]
        dist.all_gather(everyone, mine, group=self.group)
        between = [round(t.item(), 4) for t in everyone]
        slowest = max(range(self.world), key=between.__getitem__)
        return {"rank_between_s": between, "straggler": slowest, "straggle_s": round(between[slowest] - min(between), 4)}

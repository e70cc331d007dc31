"""Non-finite steps and loss spikes, judged from each step's loss and gradient norm.

A non-finite step's update was skipped by the engine; `nonfinite_in_a_row` of them
in a row raise `Diverged`, and the controller rolls back to the latest checkpoint
skipping those batches (PaLM, Chowdhery et al. 2022, section 5.1, restarted before
a spike and skipped the batches around it). A spike is a loss more than
`spike_zscore` standard deviations above the mean of the last `spike_window`
finite losses: logged, or with `on_spike: rollback` rolled back like non-finite steps.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from lmforge.engines.base import StepStats
from lmforge.errors import Diverged
from lmforge.events import Event, LossSpike, Nonfinite, Overflow
from lmforge.guards.config import GuardSpec

MIN_HISTORY = 5  # losses needed before a spike can be judged at all


class DivergenceGuard:
    def __init__(self, guards: GuardSpec):
        self.limit, self.zscore, self.roll_back_spikes = guards.nonfinite_in_a_row, guards.spike_zscore, guards.on_spike == "rollback"
        self.in_a_row: list[int] = []
        self.history: deque[float] = deque(maxlen=guards.spike_window)

    def observe(self, step: int, stats: StepStats) -> list[Event]:
        """Events for this step; raises Diverged at the limit."""
        if stats.overflow:  # fp16's loss scale skipped the step: no divergence, and no history
            return [Overflow(step=step, loss=stats.loss, loss_scale=stats.loss_scale or 0.0, next_scale=stats.next_loss_scale)]
        if not stats.finite:
            self.in_a_row.append(step)
            event = Nonfinite(
                step=step,
                loss=_json_number(stats.loss),
                grad_norm=_json_number(stats.grad_norm),
                in_a_row=len(self.in_a_row),
                limit=self.limit,
                update_skipped=stats.update_skipped,
            )
            if len(self.in_a_row) >= self.limit:
                raise Diverged(list(self.in_a_row))
            return [event]
        self.in_a_row = []
        events = []
        if len(self.history) >= MIN_HISTORY:
            mean, spread = statistics.fmean(self.history), statistics.pstdev(self.history)
            z = (stats.loss - mean) / spread if spread > 0 else 0.0
            if z > self.zscore:
                spike = LossSpike(step=step, loss=stats.loss, zscore=round(z, 2), window_mean=mean)
                if self.roll_back_spikes:
                    raise Diverged([step], f"loss spike at step {step}: {spike.describe()}")
                events.append(spike)
        self.history.append(stats.loss)
        return events


def _json_number(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)  # "nan", "inf": JSON has no such numbers

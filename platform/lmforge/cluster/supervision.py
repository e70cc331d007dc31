"""One failure budget for the job's two supervisors: the controller restarts the
ranks after a failure, the driver replaces a controller that died. Both spend the
same `fault_tolerance.max_failures`, wait the same backoff, and a replacement
controller continues the count where the dead one left it (`Handoff`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pydantic import BaseModel

MAX_BACKOFF_S = 60.0


class Handoff(BaseModel):
    """What a replacement controller continues from: the failures and rollbacks spent
    so far (this one's death included), the last step trained, and when it failed
    (its recovery is reported against that)."""

    failures: int
    rollbacks: int = 0
    step: int
    failed_at: float


@dataclass
class FailureBudget:
    max_failures: int
    backoff_s: float
    failures: int = 0

    @classmethod
    def of(cls, policy, failures: int = 0) -> "FailureBudget":
        """`policy`: the job's `fault_tolerance` section."""
        return cls(policy.max_failures, policy.backoff_s, failures)

    @property
    def used_up(self) -> bool:
        return self.failures >= self.max_failures

    def spend(self) -> int:
        """Count one failure; returns the restart it leads to (1 for the first)."""
        self.failures += 1
        return self.failures

    def backoff(self) -> float:
        """Before the n-th restart: `backoff_s` doubled n-1 times, at most a minute."""
        return min(MAX_BACKOFF_S, self.backoff_s * 2 ** (self.failures - 1))

    def wait(self) -> None:
        time.sleep(self.backoff())

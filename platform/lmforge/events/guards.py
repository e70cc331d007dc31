"""What the guards and fault handling say: non-finite steps, fp16 overflows, loss
spikes, rollbacks, out-of-memory retries, hangs and leaks."""

# pyright: reportIncompatibleVariableOverride=false
# (each kind narrows the `event` tag to its Literal: that is how a discriminated union is declared)
from __future__ import annotations

from typing import Literal, Optional, Union

from lmforge.events.base import Event, WithReport


class Nonfinite(Event):
    event: Literal["nonfinite"] = "nonfinite"
    step: int
    loss: Union[float, str]  # "nan", "inf": JSON has no such numbers
    grad_norm: Union[float, str]
    in_a_row: int
    limit: int
    update_skipped: bool

    def line(self) -> str:
        update = "skipped" if self.update_skipped else "applied by DeepSpeed"
        return f"step {self.step}: loss {self.loss}, grad norm {self.grad_norm}: not finite, update {update} ({self.in_a_row}/{self.limit} in a row)"

    def metrics(self) -> dict[str, float]:
        return {"nonfinite_in_a_row": self.in_a_row}


class Overflow(Event):
    """fp16: the step's gradients overflowed at its loss scale; its update was skipped
    and the scale halved (not a divergence: the loss was finite)."""

    event: Literal["overflow"] = "overflow"
    step: int
    loss: float
    loss_scale: float  # the scale the step used
    next_scale: Optional[float] = None  # what the next step uses

    def line(self) -> str:
        after = f"; the scale is now {self.next_scale:g}" if self.next_scale is not None else ""
        return f"step {self.step}: gradients overflowed at loss scale {self.loss_scale:g}, update skipped{after}"

    def metrics(self) -> dict[str, float]:
        return {"overflows": 1.0}


class LossSpike(Event):
    event: Literal["loss_spike"] = "loss_spike"
    step: int
    loss: float
    zscore: float
    window_mean: float

    def describe(self) -> str:
        return f"{self.loss:.4f}, {self.zscore} standard deviations above the recent mean {self.window_mean:.4f}"

    def line(self) -> str:
        return f"step {self.step}: loss spike {self.describe()}"

    def metrics(self) -> dict[str, float]:
        return {"loss_spike_zscore": self.zscore}


class Rollback(Event):
    event: Literal["rollback"] = "rollback"
    step: int
    steps: list[int]
    skip_batches: list[int]
    cause: Optional[str] = None
    rollback: int
    max_rollbacks: int

    def line(self) -> str:
        cause = self.cause or f"steps {self.steps} were not finite"
        return (
            f"rollback {self.rollback}/{self.max_rollbacks}: {cause}; restarting from the latest "
            f"checkpoint, skipping the batches of steps {self.skip_batches}"
        )

    def metrics(self) -> dict[str, float]:
        return {"rollbacks": self.rollback}


class OutOfMemoryEvent(WithReport):
    event: Literal["out_of_memory"] = "out_of_memory"
    step: int
    rank: int
    micro_batch: int
    retry_micro_batch: Optional[int] = None  # None: no smaller micro-batch is left

    def line(self) -> str:
        then = (
            f"retrying from the latest checkpoint with micro-batch {self.retry_micro_batch}"
            if self.retry_micro_batch
            else "no smaller micro-batch is left"
        )
        return f"out of memory at step {self.step} on rank {self.rank} with micro-batch {self.micro_batch}; report: {self.report_path}; {then}"

    def metrics(self) -> dict[str, float]:
        return {"oom_micro_batch": self.micro_batch}


class Hang(WithReport):
    """No step for `fault_tolerance.step_timeout_s`: what every rank was doing (its
    process state and Python stack, in the report), and the rank holding the others
    up where that can be told."""

    event: Literal["hang"] = "hang"
    step: int
    behind: Optional[int] = None
    doing: Optional[str] = None  # the rank behind: its process state and innermost frame

    def line(self) -> str:
        who = f"rank {self.behind} is behind ({self.doing})" if self.behind is not None else "no single rank is behind"
        return f"hang after step {self.step}: {who}; every rank's stack: {self.report_path}"


class Leak(Event):
    event: Literal["leak"] = "leak"
    step: int
    kind: str
    tensors: int
    per_step: float
    bytes_per_step: int

    def line(self) -> str:
        return (
            f"step {self.step}: {self.tensors} live tensors of {self.kind}, +{self.per_step} per step "
            f"(+{self.bytes_per_step:,} bytes per step): something keeps them across steps"
        )

    def metrics(self) -> dict[str, float]:
        return {"leak_bytes_per_step": self.bytes_per_step}

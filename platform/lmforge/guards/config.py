"""The job file's `guards` section (non-finite steps, loss spikes, out-of-memory
retries, leaks) and its `debug` section (fault injection, to see the guards work)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from lmforge.section import Section


class GuardSpec(Section):
    nonfinite_in_a_row: int = Field(
        3,
        ge=1,
        description="non-finite losses or grad norms in a row (each skips its update) before rolling back to the latest checkpoint and skipping those batches",
    )
    max_rollbacks: int = Field(3, ge=0, description="rollbacks (non-finite steps, or spikes under on_spike: rollback) before the job fails")
    spike_window: int = Field(50, ge=5, description="steps of loss history that a spike is measured against")
    spike_zscore: float = Field(6.0, gt=0, description="a loss this many standard deviations above the window's mean is a spike")
    on_spike: Literal["log", "rollback"] = Field(
        "log",
        description="log: record the spike and go on; rollback: restart from the latest checkpoint skipping the spike's batch (as for non-finite steps)",
    )
    oom_min_micro_batch: int = Field(
        1, ge=1, description="on out-of-memory, retry with half the micro-batch (twice the accumulation) down to this, then fail"
    )
    skip_batches: list[int] = Field([], description="steps whose batch is read but not trained on (a rollback adds the offending ones)")
    leak_check: bool = Field(False, description="debug: report tensors that stay alive across steps, and their growth per step")


class DebugSpec(Section):
    """Fault injection, to see the guards work (tests, drills)."""

    nan_at_steps: list[int] = Field([], description="make these steps' loss NaN")
    spike_at_steps: list[int] = Field([], description="make these steps' loss spike (the logits scaled up)")
    overflow_at_steps: list[int] = Field(
        [], description="make these steps' gradients overflow (infinite), their loss finite: with fp16 the loss scale skips them"
    )
    oom_at_step: Optional[int] = Field(None, gt=0, description="raise torch.OutOfMemoryError on rank 0 at this step ...")
    oom_above_micro_batch: int = Field(0, ge=0, description="... while train.micro_batch is larger than this")
    leak_per_step: bool = Field(False, description="keep one small tensor alive per step (a leak for guards.leak_check to find)")
    slow_rank: Optional[int] = Field(None, ge=0, description="this rank sleeps debug.slow_s before the steps in debug.slow_at_steps ...")
    slow_at_steps: list[int] = Field([], description="... (a straggler for the step rows' report to name)")
    slow_s: float = Field(0.5, gt=0)

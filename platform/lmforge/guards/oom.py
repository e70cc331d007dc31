"""Out-of-memory in a step: the smaller micro-batch the controller retries with
(the same global batch, so the data order holds). The rank's report of where the
memory went is in `guards.memory_report`; this side needs no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmforge.spec import JobSpec


def with_smaller_micro_batch(spec: JobSpec) -> JobSpec | None:
    """The job with half the micro-batch, or the largest smaller one the job's rules
    accept (the global batch whole at every dp it may run on), not below
    `guards.oom_min_micro_batch`; None when there is none."""
    for micro in range(spec.train.micro_batch // 2, max(1, spec.guards.oom_min_micro_batch) - 1, -1):
        try:
            return spec.with_micro_batch(micro)
        except ValueError:  # pydantic's ValidationError: this size breaks a rule
            continue
    return None

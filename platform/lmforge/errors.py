"""Errors that reach the user as one line and exit code 2.

Anything raised as a `UserError` is the user's input being wrong (a field, a
file, a cluster too small); the CLI prints it without a traceback.
"""

from pydantic import ValidationError


class UserError(Exception):
    """Bad input: printed as one line, exit code 2, nothing started."""

    exit_code = 2


class TrainingFailed(RuntimeError):
    """A rank or the controller raised during training: printed as one line with
    where the full traceback was saved, exit code 1."""

    exit_code = 1


class CheckpointWritesFailing(RuntimeError):
    """`checkpoint.max_failed_writes` checkpoints in a row could not be written:
    restarting would not help, so the controller does not retry it."""


class Diverged(RuntimeError):
    """`guards.nonfinite_in_a_row` steps in a row had a non-finite loss or gradient
    norm, or (with `guards.on_spike: rollback`) a step's loss spiked: the controller
    rolls back to the latest checkpoint and skips their batches."""

    def __init__(self, steps: list[int], reason: str | None = None):
        super().__init__(steps, reason)  # all the arguments, so the exception pickles across actors
        self.steps, self.reason = steps, reason

    def __str__(self) -> str:
        return self.reason or f"non-finite loss or gradient norm at steps {', '.join(map(str, self.steps))}"


class OutOfMemory(RuntimeError):
    """A rank ran out of device memory in a step; `report` says where the memory went.
    The controller retries with a smaller micro-batch down to a floor."""

    def __init__(self, step: int, rank: int, micro_batch: int, report: str):
        super().__init__(step, rank, micro_batch, report)
        self.step, self.rank, self.micro_batch, self.report = step, rank, micro_batch, report

    def __str__(self) -> str:
        return f"out of memory at step {self.step} on rank {self.rank} with micro-batch {self.micro_batch}"


def first_line(err: BaseException) -> str:
    """An exception's message as one line fit for a one-line error (its first, capped)."""
    return (str(err).strip().splitlines() or [""])[0][:300]


def first_error(err: ValidationError) -> str:
    """A pydantic validation error as one line: the first problem, at its field."""
    first = err.errors()[0]
    loc = ".".join(str(part) for part in first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "unknown field"
    if not loc:
        return msg
    if msg.startswith((loc.split(".")[0] + ".", loc + ":")):
        return msg
    return f"{loc}: {msg}"

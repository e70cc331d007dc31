"""What a run's course says: steps and their metrics, restarts and restores, held-out
measures, checkpoints, layouts, readers, spares, resizes, failures and recoveries."""

# pyright: reportIncompatibleVariableOverride=false
# (each kind narrows the `event` tag to its Literal: that is how a discriminated union is declared)
from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional

from pydantic import ConfigDict

from lmforge.events.base import Event


class Step(Event):
    """One optimizer step's metrics; a loss's named terms beyond those declared ride along."""

    model_config = ConfigDict(extra="allow")
    # What MLflow charts for each step (metrics.jsonl keeps the counters beside them).
    METRICS: ClassVar[tuple[str, ...]] = (
        "loss", "ce_loss", "kd_loss", "hidden_loss", "on_policy", "lr", "grad_norm", "tokens_per_s", "mfu", "bubble", "bubble_theory",
        "step_time", "data_wait", "loss_scale", "straggle_s",
    )  # fmt: skip
    event: Literal["step"] = "step"
    step: int
    loss: float
    lr: float
    grad_norm: float
    step_time: float
    data_wait: float
    tokens_per_s: float
    mfu: Optional[float] = None
    tokens: int
    samples_consumed: int
    mixture: Optional[list[int]] = None  # samples of each source in this step
    sample_ids: Optional[list[int]] = None
    bubble: Optional[float] = None
    bubble_theory: Optional[float] = None
    ce_loss: Optional[float] = None
    kd_loss: Optional[float] = None
    hidden_loss: Optional[float] = None
    on_policy: Optional[int] = None  # the step learnt the student's own continuations
    loss_scale: Optional[float] = None  # fp16: the scale the step's loss was multiplied by
    # Each rank's seconds between its last step and this one (guards.stragglers); the
    # slowest, and how much longer than the quickest it took: its peers' wait.
    rank_between_s: Optional[list[float]] = None
    straggler: Optional[int] = None
    straggle_s: Optional[float] = None

    def metrics(self) -> dict[str, float]:
        return step_metrics(self.as_dict())


def step_metrics(row: dict[str, Any]) -> dict[str, float]:
    """What a step charts (in MLflow and TensorBoard), from its event or its
    metrics.jsonl row: its measures, and a mixture's samples of each source as shares."""
    values = {key: float(row[key]) for key in Step.METRICS if row.get(key) is not None}
    taken = row.get("mixture") or []
    return values | {f"mixture_{i}": n / sum(taken) for i, n in enumerate(taken) if sum(taken)}


class Start(Event):
    """Steps after this one are (re)trained now: whoever records them drops later ones."""

    recorded: ClassVar[bool] = False
    event: Literal["start"] = "start"
    step: int


class Restored(Event):
    event: Literal["restored"] = "restored"
    step: int
    path: str
    from_memory: bool

    def line(self) -> str:
        return f"restored step {self.step} from {self.path}"


class BatchSkipped(Event):
    event: Literal["batch_skipped"] = "batch_skipped"
    step: int

    def line(self) -> str:
        return f"step {self.step}: batch skipped (guards.skip_batches)"


class Eval(Event):
    event: Literal["eval"] = "eval"
    step: int
    eval_loss: float
    eval_ppl: float
    eval_kl: Optional[float] = None  # a distillation's, against its teachers
    eval_top1: Optional[float] = None
    batches: int
    seconds: float

    def line(self) -> str:
        teacher = f", KL to the teacher {self.eval_kl:.4f}, top-1 agreement {self.eval_top1:.1%}" if self.eval_kl is not None else ""
        return (
            f"step {self.step}: held-out loss {self.eval_loss:.4f}, perplexity {self.eval_ppl:.2f}{teacher} "
            f"({self.batches} batches, {self.seconds:.1f}s)"
        )

    def metrics(self) -> dict[str, float]:
        values = {"eval_loss": self.eval_loss, "eval_ppl": self.eval_ppl, "eval_kl": self.eval_kl, "eval_top1": self.eval_top1}
        return {key: value for key, value in values.items() if value is not None}


class Checkpoint(Event):
    recorded: ClassVar[bool] = False  # the checkpoint directory is its record
    event: Literal["checkpoint"] = "checkpoint"
    step: int
    path: str
    seconds: float
    stall_seconds: float
    pruned: list[int] = []

    def line(self) -> str:
        return f"checkpoint step {self.step} -> {self.path} ({self.seconds:.1f}s, training paused {self.stall_seconds:.2f}s)"

    def metrics(self) -> dict[str, float]:
        return {"checkpoint_seconds": self.seconds, "checkpoint_stall_seconds": self.stall_seconds}


class CheckpointFailed(Event):
    event: Literal["checkpoint_failed"] = "checkpoint_failed"
    step: int
    error: str
    ranks: list[int]
    failed_in_a_row: int
    max_failed_writes: int

    def line(self) -> str:
        return f"checkpoint step {self.step} failed ({self.failed_in_a_row}/{self.max_failed_writes} in a row): {self.error}; training goes on"

    def metrics(self) -> dict[str, float]:
        return {"checkpoint_failed_in_a_row": self.failed_in_a_row}


class CheckpointCorrupt(Event):
    event: Literal["checkpoint_corrupt"] = "checkpoint_corrupt"
    step: int
    path: str
    reason: str

    def line(self) -> str:
        return f"checkpoint {self.path} is corrupt ({self.reason}); restoring an earlier one"


class DataChanged(Event):
    event: Literal["data_changed"] = "data_changed"
    step: int
    path: str
    changes: dict[str, tuple[Any, Any]]  # field -> (the checkpoint's, now)

    def _changes(self) -> str:
        return ", ".join(f"{key} {saved} -> {now}" for key, (saved, now) in self.changes.items())

    def line(self) -> str:
        return f"resuming step {self.step} on a new data order (checkpoint.allow_data_change): {self._changes()}"

    def tags(self) -> dict[str, str]:
        return {f"lmforge.data_changed.step_{self.step}": self._changes()}


class Layout(Event):
    """Which rank runs where (the console shows it as a table)."""

    event: Literal["layout"] = "layout"
    ranks: list[dict[str, Any]]
    reused: int = 0
    step: Optional[int] = None


class Reader(Event):
    """The job's shared data reader: kept across a restart, or started anew."""

    event: Literal["reader"] = "reader"
    kept: bool
    node: str


class Spares(Event):
    event: Literal["spares"] = "spares"
    ready: int
    wanted: int
    step: Optional[int] = None

    def line(self) -> str:
        return f"spare ranks ready: {self.ready} of {self.wanted}"


class GrowPending(Event):
    event: Literal["grow_pending"] = "grow_pending"
    dp: int
    to_dp: int
    step: Optional[int] = None

    def line(self) -> str:
        return f"room for dp {self.to_dp} (now {self.dp}): growing at the next checkpoint"


class Resized(Event):
    event: Literal["resized"] = "resized"
    step: int
    from_dp: int
    dp: int
    seconds: float

    def line(self) -> str:
        return f"resized from dp {self.from_dp} to dp {self.dp} at step {self.step} in {self.seconds:.1f}s"

    def metrics(self) -> dict[str, float]:
        return {"dp": self.dp}


def _lost(nodes: Optional[list[str]]) -> str:
    return ", ".join(nodes or []) or "none"


class Failure(Event):
    event: Literal["failure"] = "failure"
    attempt: int
    max_failures: int
    step: int
    cause: str
    rank: Optional[int] = None
    nodes_lost: list[str] = []
    noticed: Optional[float] = None  # when the controller noticed, and when the rank raised
    raised: Optional[float] = None

    def line(self) -> str:
        return (
            f"failure {self.attempt}/{self.max_failures} at step {self.step}: {self.cause} "
            f"(rank {self.rank}, nodes lost: {_lost(self.nodes_lost)}); restarting from the latest checkpoint"
        )

    def metrics(self) -> dict[str, float]:
        return {"failures": self.attempt}


class Recovered(Event):
    event: Literal["recovered"] = "recovered"
    step: int
    dp: int
    seconds: float
    steps_redone: int
    nodes_lost: list[str] = []

    def line(self) -> str:
        return f"recovered in {self.seconds:.1f}s on dp {self.dp}, {self.steps_redone} steps redone, nodes lost: {_lost(self.nodes_lost)}"

    def metrics(self) -> dict[str, float]:
        return {"recovery_seconds": self.seconds}

"""What ranks, the controller and the driver say about a run, declared once: each kind
is a pydantic model that knows its console line, whether metrics.jsonl keeps it, and
its MLflow metrics and tags; and what a rank and the controller return when a run
ends (`RankResult`, `JobResult`). Sent as models between processes; JSON (`as_dict`)
only where a file or a log line holds it. No torch here: the controller imports it.
"""

# pyright: reportIncompatibleVariableOverride=false
# (each kind narrows the `event` tag to its Literal: that is how a discriminated union is declared)
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

EVENT_PREFIX = "lmforge-event "  # a line of a submitted job's event stream: this prefix, then one JSON object


class Event(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Kept in metrics.jsonl: history (commits are in the checkpoint directory itself),
    # and measurements (eval) that a restart drops after its restore point, as it does steps.
    recorded: ClassVar[bool] = True
    excluded: ClassVar[frozenset[str]] = frozenset()  # fields that travel but are not written (a report's text: a file of its own)

    event: str
    time: Optional[float] = None  # when the controller relayed it

    def line(self) -> Optional[str]:
        """Its line on the console, if it has one."""
        return None

    def metrics(self) -> dict[str, float]:
        return {}

    def tags(self) -> dict[str, str]:
        """MLflow tags: text that no metric can hold."""
        return {}

    def as_dict(self) -> dict[str, Any]:
        """What metrics.jsonl, a checkpoint's records and the event stream hold: the
        fields its sender set."""
        return {"event": self.event} | self.model_dump(mode="json", exclude_unset=True, exclude=set(self.excluded))


class Step(Event):
    """One optimizer step's metrics; a loss's named terms beyond those declared ride along."""

    model_config = ConfigDict(extra="allow")
    # What MLflow charts for each step (metrics.jsonl keeps the counters beside them).
    METRICS: ClassVar[tuple[str, ...]] = (
        "loss", "ce_loss", "kd_loss", "hidden_loss", "on_policy", "lr", "grad_norm", "tokens_per_s", "mfu", "bubble", "bubble_theory",
        "step_time", "data_wait", "loss_scale",
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


class WithReport(Event):
    """An event that carries a report: its text is written to `report_name` in the run
    directory (and the MLflow run) by the driver, which records the event with the
    file's path instead of the text."""

    excluded: ClassVar[frozenset[str]] = frozenset({"report", "report_name"})
    report: Optional[str] = None
    report_name: Optional[str] = None
    report_path: Optional[str] = None


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


EVENT_TYPES: tuple[type[Event], ...] = (
    Step,
    Start,
    Restored,
    BatchSkipped,
    Eval,
    Checkpoint,
    CheckpointFailed,
    CheckpointCorrupt,
    DataChanged,
    Layout,
    Reader,
    Spares,
    GrowPending,
    Resized,
    Failure,
    Recovered,
    Nonfinite,
    Overflow,
    LossSpike,
    Rollback,
    OutOfMemoryEvent,
    Hang,
    Leak,
)
AnyEvent = Annotated[Union[EVENT_TYPES], Field(discriminator="event")]  # type: ignore[valid-type]
_ANY_EVENT: TypeAdapter[Event] = TypeAdapter(AnyEvent)  # pyright: ignore[reportArgumentType] (a union built from the tuple above)


def parse_event(value: dict[str, Any]) -> Event:
    """An event as written (metrics.jsonl, an event line) back as its model; a
    ValidationError names what does not fit."""
    return _ANY_EVENT.validate_python(value)


class RankResult(BaseModel):
    """What a rank's trainer returns when its run ends: the step it reached, the loss
    of its last finite step, where it started, and whether it stopped early at a
    committed checkpoint (to grow)."""

    step: int
    loss: Optional[float]
    start_step: int
    stopped: bool = False


class JobResult(RankResult):
    """What the controller returns to the driver: rank 0's result, and the layout and
    data read of the attempt that finished."""

    world_size: int
    dp: int
    data_bytes_read: Optional[int] = None  # by the job's readers that lasted to its end


class InOrder:
    """A sender's numbered messages, released in its order whatever order they arrive in
    (a threaded actor may run one caller's calls out of order)."""

    def __init__(self):
        self._early: dict[int, Event] = {}
        self._next = 0

    def arrived(self, number: int, event: Event) -> list[Event]:
        """The events now in order: this one and any that waited on it; none while an earlier one is missing."""
        self._early[number] = event
        ready = []
        while self._next in self._early:
            ready.append(self._early.pop(self._next))
            self._next += 1
        return ready

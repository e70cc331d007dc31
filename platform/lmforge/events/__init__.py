"""What ranks, the controller and the driver say about a run, declared once: each kind
is a pydantic model that knows its console line, whether metrics.jsonl keeps it, and
its MLflow metrics and tags; and what a rank and the controller return when a run
ends (`RankResult`, `JobResult`). Sent as models between processes; JSON (`as_dict`)
only where a file or a log line holds it. No torch here: the controller imports it.
The kinds live in base.py (Event, WithReport), training.py (a run's course) and
guards.py (what the guards and fault handling say); the union of them is here.
"""

# pyright: reportIncompatibleVariableOverride=false
# (each kind narrows the `event` tag to its Literal: that is how a discriminated union is declared)
from __future__ import annotations

from typing import Annotated, Any, Optional, Union

from pydantic import BaseModel, Field, TypeAdapter

from lmforge.events.base import EVENT_PREFIX, Event, WithReport
from lmforge.events.guards import Hang, Leak, LossSpike, Nonfinite, OutOfMemoryEvent, Overflow, Rollback
from lmforge.events.training import (
    BatchSkipped,
    Checkpoint,
    CheckpointCorrupt,
    CheckpointFailed,
    DataChanged,
    Eval,
    Failure,
    GrowPending,
    Layout,
    Reader,
    Recovered,
    Resized,
    Restored,
    Spares,
    Start,
    Step,
    step_metrics,
)

__all__ = [
    "EVENT_PREFIX",
    "Event",
    "WithReport",
    "Hang",
    "Leak",
    "LossSpike",
    "Nonfinite",
    "OutOfMemoryEvent",
    "Overflow",
    "Rollback",
    "BatchSkipped",
    "Checkpoint",
    "CheckpointCorrupt",
    "CheckpointFailed",
    "DataChanged",
    "Eval",
    "Failure",
    "GrowPending",
    "Layout",
    "Reader",
    "Recovered",
    "Resized",
    "Restored",
    "Spares",
    "Start",
    "Step",
    "step_metrics",
    "EVENT_TYPES",
    "AnyEvent",
    "parse_event",
    "RankResult",
    "JobResult",
    "InOrder",
]

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

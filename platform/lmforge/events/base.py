"""The event every kind derives from: its console line, whether metrics.jsonl keeps
it, its MLflow metrics and tags, and `as_dict` for files and log lines; and the base
of events that carry a report the driver writes to a file of its own."""

# pyright: reportIncompatibleVariableOverride=false
# (each kind narrows the `event` tag to its Literal: that is how a discriminated union is declared)
from __future__ import annotations

from typing import Any, ClassVar, Optional

from pydantic import BaseModel, ConfigDict

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


class WithReport(Event):
    """An event that carries a report: its text is written to `report_name` in the run
    directory (and the MLflow run) by the driver, which records the event with the
    file's path instead of the text."""

    excluded: ClassVar[frozenset[str]] = frozenset({"report", "report_name"})
    report: Optional[str] = None
    report_name: Optional[str] = None
    report_path: Optional[str] = None

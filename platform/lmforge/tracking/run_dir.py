"""The run directory's machine-readable files: metrics.jsonl (one JSON object per
optimizer step, plus held-out evaluations and failure, recovery and guard events), samples.jsonl (the sample
ids of every step, when recorded), skip_batches.json (the batches rollbacks skip),
memory reports of out-of-memory steps, and summary.json (written when the job ends)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from lmforge.events import Step
from lmforge.tracking.summary import RunSummary

STEP_FIELDS = (
    "step",
    *Step.METRICS,
    "tokens",
    "samples_consumed",
    "mixture",
    "straggler",
    "rank_between_s",
    "time",
)  # a step's line in metrics.jsonl


REDONE_EVENTS = {"eval"}  # measured again when their step is


class RunDir:
    def __init__(self, path: str):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.path / "metrics.jsonl"
        self.samples_path = self.path / "samples.jsonl"
        self.summary_path = self.path / "summary.json"
        self.skip_path = self.path / "skip_batches.json"

    def rewind(self, step: int) -> None:
        """Drop step and evaluation lines after `step`: those steps are about to be
        trained again, so each appears once. Other event lines are history and stay."""
        for path in (self.metrics_path, self.samples_path):
            if not path.exists():
                continue
            rows = [line for line in path.read_text().splitlines() if line.strip()]
            kept = [line for line in rows if row_is_history(row := json.loads(line)) or row["step"] <= step]
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, path)

    def restore_records(self, records: list[dict]) -> int:
        """Append the step and evaluation lines a checkpoint carries that metrics.jsonl
        lacks (its driver was killed between the commit and their arrival); returns
        how many."""
        rows = (json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()) if self.metrics_path.exists() else ()
        present = {(row.get("event", "step"), row["step"]) for row in rows if "step" in row}
        missing = [record for record in records if (record["event"], record["step"]) not in present]
        for record in missing:
            if record["event"] == "step":
                self.append_step(record)
            else:
                self.append_event(record)
        return len(missing)

    def steps(self) -> list[dict]:
        """The step lines of metrics.jsonl."""
        if not self.metrics_path.exists():
            return []
        rows = (json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip())
        return [row for row in rows if "event" not in row]

    def append_step(self, event: dict) -> None:
        _append(self.metrics_path, {k: event[k] for k in STEP_FIELDS if k in event})
        if "sample_ids" in event:
            _append(self.samples_path, {"step": event["step"], "ids": event["sample_ids"]})

    def append_event(self, event: dict) -> None:
        _append(self.metrics_path, event)

    def write_report(self, name: str, text: str) -> Path:
        path = self.path / name
        path.write_text(text)
        return path

    def skip_batches(self) -> list[int]:
        """Steps whose batches earlier rollbacks of this run skipped."""
        return json.loads(self.skip_path.read_text()) if self.skip_path.exists() else []

    def record_skip_batches(self, steps: list[int]) -> None:
        tmp = self.skip_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(sorted(set(steps))) + "\n")
        os.replace(tmp, self.skip_path)

    def write_summary(self, summary: RunSummary) -> None:
        tmp = self.summary_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(summary.as_json(), indent=2) + "\n")
        os.replace(tmp, self.summary_path)


def row_is_history(row: dict) -> bool:
    """An event line that stays when steps are redone (a failure, a restore, ...)."""
    return "event" in row and row["event"] not in REDONE_EVENTS


def _append(path: Path, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")

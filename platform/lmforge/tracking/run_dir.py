"""The run directory's machine-readable files: metrics.jsonl (one JSON object per
optimizer step) and summary.json (written when the job ends)."""

from __future__ import annotations

import json
import os
from pathlib import Path

STEP_FIELDS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "bubble", "bubble_theory", "step_time", "data_wait", "tokens", "samples_consumed", "time")


class RunDir:
    def __init__(self, path: str):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.path / "metrics.jsonl"
        self.summary_path = self.path / "summary.json"

    def rewind(self, step: int) -> None:
        """Drop lines after `step`: those steps are about to be trained again."""
        if not self.metrics_path.exists():
            return
        kept = [line for line in self.metrics_path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
        tmp = self.metrics_path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.metrics_path)

    def append_step(self, event: dict) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps({k: event[k] for k in STEP_FIELDS if k in event}) + "\n")

    def write_summary(self, summary: dict) -> None:
        tmp = self.summary_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, self.summary_path)

"""The small lm-evaluation-harness tasks the tests ship (a multiple-choice and a
generation task, their data beside them: nothing from the hub), and how to read what
an lm-eval run wrote."""

import json
from pathlib import Path

HARNESS = Path(__file__).parent / "integration" / "harness"
HARNESS_TASKS = ("lmforge_tiny_choice", "lmforge_tiny_generation")


def offline(out: Path) -> dict:
    """lm-eval's datasets read the shipped files only; their cache under `out`."""
    return {"HF_HOME": str(out / "hf-home"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def harness_output(out: Path, tasks) -> tuple[dict, dict]:
    """What an lm-eval run wrote to `out`: each task's samples by doc_id, each task's metrics."""
    samples = {
        task: {row["doc_id"]: row for row in map(json.loads, next(out.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines())} for task in tasks
    }
    return samples, json.loads(next(out.rglob("results_*.json")).read_text())["results"]

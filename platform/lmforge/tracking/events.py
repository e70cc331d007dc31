"""How the driver shows, records and tracks each kind of controller event.

Steps and launches are handled by the caller; every other kind is described here
once: its line on the console, whether it goes into metrics.jsonl, and which
MLflow metrics it sets.
"""

from __future__ import annotations

from typing import Callable


def _lost(event: dict) -> str:
    return ", ".join(event.get("nodes_lost") or []) or "none"


MESSAGES: dict[str, Callable[[dict], str]] = {
    "spares": lambda e: f"spare ranks ready: {e['ready']} of {e['wanted']}",
    "checkpoint": lambda e: f"checkpoint step {e['step']} -> {e['path']} ({e['seconds']:.1f}s, training paused {e['stall_seconds']:.2f}s)",
    "checkpoint_failed": lambda e: (
        f"checkpoint step {e['step']} failed ({e['failed_in_a_row']}/{e['max_failed_writes']} in a row): {e['error']}; training goes on"
    ),
    "checkpoint_corrupt": lambda e: f"checkpoint {e['path']} is corrupt ({e['reason']}); restoring an earlier one",
    "restored": lambda e: f"restored step {e['step']} from {e['path']}",
    "grow_pending": lambda e: f"room for dp {e['to_dp']} (now {e['dp']}): growing at the next checkpoint",
    "resized": lambda e: f"resized from dp {e['from_dp']} to dp {e['dp']} at step {e['step']} in {e['seconds']:.1f}s",
    "failure": lambda e: (
        f"failure {e['attempt']}/{e['max_failures']} at step {e['step']}: {e['cause']} "
        f"(rank {e['rank']}, nodes lost: {_lost(e)}); restarting from the latest checkpoint"
    ),
    "recovered": lambda e: f"recovered in {e['seconds']:.1f}s on dp {e['dp']}, {e['steps_redone']} steps redone, nodes lost: {_lost(e)}",
}

# Kept in metrics.jsonl as history (commits are in the checkpoint directory itself).
RECORDED = {"layout", "spares", "checkpoint_failed", "checkpoint_corrupt", "restored", "grow_pending", "resized", "failure", "recovered"}

METRICS: dict[str, Callable[[dict], dict[str, float]]] = {
    "checkpoint": lambda e: {"checkpoint_seconds": e["seconds"], "checkpoint_stall_seconds": e["stall_seconds"]},
    "checkpoint_failed": lambda e: {"checkpoint_failed_in_a_row": e["failed_in_a_row"]},
    "resized": lambda e: {"dp": e["dp"]},
    "failure": lambda e: {"failures": e["attempt"]},
    "recovered": lambda e: {"recovery_seconds": e["seconds"]},
}

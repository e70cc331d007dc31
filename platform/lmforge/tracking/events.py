"""How the driver shows, records and tracks each kind of controller (or driver) event.

Steps and launches are handled by the caller; every other kind is described here
once: its line on the console, whether it goes into metrics.jsonl, and which
MLflow metrics or tags it sets.
"""

from __future__ import annotations

from typing import Callable

EVENT_PREFIX = "lmforge-event "  # a line of a submitted job's event stream: this prefix, then one JSON object


def _lost(event: dict) -> str:
    return ", ".join(event.get("nodes_lost") or []) or "none"


def _changes(event: dict) -> str:
    return ", ".join(f"{key} {saved} -> {now}" for key, (saved, now) in event["changes"].items())


MESSAGES: dict[str, Callable[[dict], str]] = {
    "spares": lambda e: f"spare ranks ready: {e['ready']} of {e['wanted']}",
    "checkpoint": lambda e: f"checkpoint step {e['step']} -> {e['path']} ({e['seconds']:.1f}s, training paused {e['stall_seconds']:.2f}s)",
    "checkpoint_failed": lambda e: (
        f"checkpoint step {e['step']} failed ({e['failed_in_a_row']}/{e['max_failed_writes']} in a row): {e['error']}; training goes on"
    ),
    "checkpoint_corrupt": lambda e: f"checkpoint {e['path']} is corrupt ({e['reason']}); restoring an earlier one",
    "data_changed": lambda e: f"resuming step {e['step']} on a new data order (checkpoint.allow_data_change): {_changes(e)}",
    "restored": lambda e: f"restored step {e['step']} from {e['path']}",
    "grow_pending": lambda e: f"room for dp {e['to_dp']} (now {e['dp']}): growing at the next checkpoint",
    "resized": lambda e: f"resized from dp {e['from_dp']} to dp {e['dp']} at step {e['step']} in {e['seconds']:.1f}s",
    "failure": lambda e: (
        f"failure {e['attempt']}/{e['max_failures']} at step {e['step']}: {e['cause']} "
        f"(rank {e['rank']}, nodes lost: {_lost(e)}); restarting from the latest checkpoint"
    ),
    "recovered": lambda e: f"recovered in {e['seconds']:.1f}s on dp {e['dp']}, {e['steps_redone']} steps redone, nodes lost: {_lost(e)}",
    "nonfinite": lambda e: (
        f"step {e['step']}: loss {e['loss']}, grad norm {e['grad_norm']}: not finite, update "
        f"{'skipped' if e['update_skipped'] else 'applied by DeepSpeed'} ({e['in_a_row']}/{e['limit']} in a row)"
    ),
    "rollback": lambda e: (
        f"rollback {e['rollback']}/{e['max_rollbacks']}: {e.get('cause') or 'steps ' + str(e['steps']) + ' were not finite'}; restarting from the latest "
        f"checkpoint, skipping the batches of steps {e['skip_batches']}"
    ),
    "eval": lambda e: (
        f"step {e['step']}: held-out loss {e['eval_loss']:.4f}, perplexity {e['eval_ppl']:.2f}"
        + (f", KL to the teacher {e['eval_kl']:.4f}, top-1 agreement {e['eval_top1']:.1%}" if "eval_kl" in e else "")
        + f" ({e['batches']} batches, {e['seconds']:.1f}s)"
    ),
    "batch_skipped": lambda e: f"step {e['step']}: batch skipped (guards.skip_batches)",
    "loss_spike": lambda e: (
        f"step {e['step']}: loss spike {e['loss']:.4f}, {e['zscore']} standard deviations above the recent mean {e['window_mean']:.4f}"
    ),
    "out_of_memory": lambda e: (
        f"out of memory at step {e['step']} on rank {e['rank']} with micro-batch {e['micro_batch']}; report: {e['report_path']}; "
        + (
            f"retrying from the latest checkpoint with micro-batch {e['retry_micro_batch']}"
            if e["retry_micro_batch"]
            else "no smaller micro-batch is left"
        )
    ),
    "leak": lambda e: (
        f"step {e['step']}: {e['tensors']} live tensors of {e['kind']}, +{e['per_step']} per step "
        f"(+{e['bytes_per_step']:,} bytes per step): something keeps them across steps"
    ),
}

# Kept in metrics.jsonl: history (commits are in the checkpoint directory itself), and
# measurements (eval) that a restart drops after its restore point, as it does steps.
RECORDED = {
    "layout",
    "reader",
    "data_changed",
    "eval",
    "spares",
    "checkpoint_failed",
    "checkpoint_corrupt",
    "restored",
    "grow_pending",
    "resized",
    "failure",
    "recovered",
    "nonfinite",
    "rollback",
    "batch_skipped",
    "loss_spike",
    "out_of_memory",
    "leak",
}

METRICS: dict[str, Callable[[dict], dict[str, float]]] = {
    "checkpoint": lambda e: {"checkpoint_seconds": e["seconds"], "checkpoint_stall_seconds": e["stall_seconds"]},
    "checkpoint_failed": lambda e: {"checkpoint_failed_in_a_row": e["failed_in_a_row"]},
    "eval": lambda e: {k: e[k] for k in ("eval_loss", "eval_ppl", "eval_kl", "eval_top1") if k in e},
    "resized": lambda e: {"dp": e["dp"]},
    "failure": lambda e: {"failures": e["attempt"]},
    "recovered": lambda e: {"recovery_seconds": e["seconds"]},
    "nonfinite": lambda e: {"nonfinite_in_a_row": e["in_a_row"]},
    "rollback": lambda e: {"rollbacks": e["rollback"]},
    "loss_spike": lambda e: {"loss_spike_zscore": e["zscore"]},
    "out_of_memory": lambda e: {"oom_micro_batch": e["micro_batch"]},
    "leak": lambda e: {"leak_bytes_per_step": e["bytes_per_step"]},
}

# Set on the MLflow run as tags (text that no metric can hold).
TAGS: dict[str, Callable[[dict], dict[str, str]]] = {
    "data_changed": lambda e: {f"lmforge.data_changed.step_{e['step']}": _changes(e)},
}

"""Failure injection helpers: wait for training to reach a step, then break something."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest


def json_lines(path: Path) -> list[dict]:
    """The complete lines of a JSON-lines file: the driver may be half-way through
    appending the last one while a watcher reads."""
    text = path.read_text()
    lines = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
    return [json.loads(line) for line in lines if line.strip()]


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    rows = json_lines(path)
    return max((row["step"] for row in rows if "event" not in row), default=0)


class Condition:
    """A test for progress, with words for the error when it never holds."""

    def __init__(self, test, what: str):
        self.test, self.what = test, what

    def __call__(self) -> bool:
        return self.test()

    def __and__(self, other: "Condition") -> "Condition":
        return Condition(lambda: self() and other(), f"{self.what} and {other.what}")

    def __or__(self, other: "Condition") -> "Condition":
        return Condition(lambda: self() or other(), f"{self.what} or {other.what}")


def reached_step(run_dir: Path, step: int) -> Condition:
    return Condition(lambda: steps_done(run_dir) >= step, f"step {step} in {run_dir.name}/metrics.jsonl")


def recorded_event(run_dir: Path, kind: str) -> Condition:
    return Condition(
        lambda: (run_dir / "metrics.jsonl").exists() and any(e["event"] == kind for e in events(run_dir)),
        f"a {kind!r} event in {run_dir.name}/metrics.jsonl",
    )


def committed(run_dir: Path, step: int) -> Condition:
    return Condition(lambda: (run_dir / "checkpoints" / f"step_{step:08d}" / "commit.json").exists(), f"step {step}'s commit.json")


def wait_until(condition, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while not condition():
        if time.time() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f}s for {getattr(condition, 'what', 'training progress')}, which never came")
        time.sleep(0.05)


def when(condition, action, timeout_s: float = 300) -> threading.Thread:
    """Run `action()` once `condition()` holds (in a background thread)."""

    def watch():
        wait_until(condition, timeout_s)
        action()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def when_step_reached(run_dir: Path, step: int, action, timeout_s: float = 300) -> threading.Thread:
    """Run `action()` once training has reported `step`: the driver writes steps to
    metrics.jsonl as it drains them, so training may be a few steps further by then.
    `when(committed(...))` acts within moments of a checkpoint's commit instead."""
    return when(reached_step(run_dir, step), action, timeout_s)


def kill_one_rank_process(rank_index: int = 1, sig: int = signal.SIGKILL) -> int:
    """Signal one rank actor's process among this process's descendants (the test's
    own Ray cluster): SIGKILL as if its machine had lost it, SIGSTOP to hang it.
    Returns the pid."""
    victim = actor_processes("Worker")[rank_index]
    os.kill(victim.pid, sig)
    return victim.pid


def actor_processes(actor_class: str) -> list[psutil.Process]:
    """This test's live processes of one actor class, oldest first."""
    return sorted(
        (p for p in psutil.Process(os.getpid()).children(recursive=True) if _cmdline(p).startswith(f"ray::{actor_class}")),
        key=lambda p: p.create_time(),
    )


def _cmdline(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def step_rows(run_dir: Path, name: str = "metrics.jsonl") -> dict[int, dict]:
    rows = json_lines(run_dir / name)
    steps = [row for row in rows if "event" not in row]
    assert len({row["step"] for row in steps}) == len(steps), "a step appears twice"
    return {row["step"]: row for row in steps}


def events(run_dir: Path) -> list[dict]:
    rows = json_lines(run_dir / "metrics.jsonl")
    return [row for row in rows if "event" in row]


def same_as_uninterrupted(run_dir: Path, uninterrupted: tuple, rel: float = 1e-5) -> None:
    """Every step once, with the uninterrupted run's loss and exactly its samples."""
    reference, reference_samples = uninterrupted
    losses = step_rows(run_dir)
    assert sorted(losses) == sorted(reference)
    for step, row in reference.items():
        assert losses[step]["loss"] == pytest.approx(row["loss"], rel=rel), step
    samples = {step: row["ids"] for step, row in step_rows(run_dir, "samples.jsonl").items()}
    assert samples == {step: row["ids"] for step, row in reference_samples.items()}

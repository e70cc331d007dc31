"""What a hung job's ranks were doing. Each rank's process state and Python stack
(every thread, read by py-spy on the rank's node without stopping the process, so a
rank blocked in a collective or stopped by a signal answers alike), and the rank
that holds the others up, where one can be told apart."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Optional

import ray
from pydantic import BaseModel
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from lmforge.events import Hang

STACK_TIMEOUT_S = 20.0
# A thread in one of these waits on its peers: the ranks whose threads all do are
# not the ones behind (py-spy prints each frame with its file).
WAITING = ("torch/distributed/", "torch/_C/_distributed", "/gloo", "/nccl")
STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O", "T": "stopped by a signal", "t": "stopped by a debugger", "Z": "a zombie"}


class RankHung(RuntimeError):
    """Some rank stopped making progress (stuck in a collective, a stopped process)."""


class RankStack(BaseModel):
    rank: int
    pid: int
    state: str  # as /proc/PID/status says it: "S (sleeping)", "T (stopped)"...
    stack: str  # py-spy's dump, or why there is none

    @property
    def stopped_or_stuck(self) -> bool:
        return self.state[:1] in ("T", "t", "D")

    @property
    def waiting_on_peers(self) -> bool:
        return any(marker in self.stack for marker in WAITING)

    def doing(self) -> str:
        innermost = next((line.strip() for line in self.stack.splitlines() if line.startswith("    ")), "no Python frame")
        return f"pid {self.pid}, {STATES.get(self.state[:1], self.state)}, in {innermost}"


@ray.remote(num_cpus=0)
def _stack_of(rank: int, pid: int) -> RankStack:
    try:
        with open(f"/proc/{pid}/status") as status:
            state = next((line.split(":", 1)[1].strip() for line in status if line.startswith("State:")), "?")
    except OSError as err:
        return RankStack(rank=rank, pid=pid, state="gone", stack=f"the process is gone ({err.strerror})")
    spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
    if spy is None:
        return RankStack(rank=rank, pid=pid, state=state, stack="py-spy is not installed on this node")
    try:
        dump = subprocess.run([spy, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True, text=True, timeout=STACK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return RankStack(rank=rank, pid=pid, state=state, stack=f"py-spy did not answer within {STACK_TIMEOUT_S:.0f}s")
    return RankStack(rank=rank, pid=pid, state=state, stack=dump.stdout if dump.returncode == 0 else f"py-spy failed: {dump.stderr.strip()}")


def rank_stacks(pids: list[int], nodes: list[str]) -> list[RankStack]:
    """Every rank's stack, read on its own node (at once, within STACK_TIMEOUT_S and a bit)."""
    refs = [
        _stack_of.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(rank, pid)
        for rank, (pid, node) in enumerate(zip(pids, nodes))
    ]
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=STACK_TIMEOUT_S + 10)
    stacks = []
    for rank, (ref, pid) in enumerate(zip(refs, pids)):
        try:
            stacks.append(ray.get(ref) if ref in done else RankStack(rank=rank, pid=pid, state="?", stack="its node did not answer"))
        except ray.exceptions.RayError as err:
            stacks.append(RankStack(rank=rank, pid=pid, state="?", stack=f"its node did not answer ({type(err).__name__})"))
    return stacks


def behind(stacks: list[RankStack]) -> Optional[RankStack]:
    """The one rank holding the others up: stopped or stuck in I/O, else the only one
    not waiting on its peers; None where no single rank stands out."""
    for suspects in ([s for s in stacks if s.stopped_or_stuck], [s for s in stacks if not s.waiting_on_peers]):
        if len(suspects) == 1:
            return suspects[0]
    return None


def stacks_report(step: int, stacks: list[RankStack], stalled_s: float) -> str:
    lines = [f"No step for {stalled_s:.0f}s after step {step}: every rank's Python stack (py-spy dump --nonblocking).", ""]
    for s in stacks:
        lines += [f"== rank {s.rank}: pid {s.pid}, {s.state}", s.stack.rstrip(), ""]
    return "\n".join(lines)


def diagnose(step: int, pids: list[int], nodes: list[str], stalled_s: float, step_timeout_s: float) -> tuple[Hang, RankHung]:
    """No step for `stalled_s` after `step`: the hang event (every rank's stack in its
    report, the rank behind named) and the error that ends the attempt."""
    stacks = rank_stacks(pids, nodes)
    slow = behind(stacks)
    hang = Hang(
        step=step,
        behind=slow.rank if slow else None,
        doing=slow.doing() if slow else None,
        report=stacks_report(step, stacks, stalled_s),
        report_name=f"hang-step{step}.txt",
    )
    who = f"; rank {slow.rank} is behind ({slow.doing()})" if slow else ""
    return hang, RankHung(f"no step for {stalled_s:.0f}s after step {step} (fault_tolerance.step_timeout_s {step_timeout_s:g}){who}")

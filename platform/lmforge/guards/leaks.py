"""A debug check for tensors kept alive across steps (`losses.append(loss)` keeps
each step's graph): live tensors are counted by kind after every step, and a kind
that grows by at least one tensor per step is reported (once) with its growth.

It walks every object the garbage collector tracks, so it costs milliseconds to
seconds per step: a debugging aid (`guards.leak_check`), off by default.
"""

from __future__ import annotations

import gc
from collections import Counter

import torch

from lmforge.events import Event, Leak

WARMUP_STEPS = 2  # optimizer states and caches appear in the first steps
EVERY = 5  # steps between judgements


class LeakCheck:
    def __init__(self):
        self.baseline: tuple[int, Counter, Counter] | None = None
        self.reported: set[tuple] = set()

    def after_step(self, step: int) -> list[Event]:
        if step < WARMUP_STEPS or (self.baseline is not None and (step - self.baseline[0]) % EVERY):
            return []
        counts, sizes = live_tensors()
        if self.baseline is None:
            self.baseline = (step, counts, sizes)
            return []
        since, before, before_bytes = self.baseline
        steps = step - since
        events = []
        for kind, count in counts.items():
            grown = count - before.get(kind, 0)
            if grown >= steps and kind not in self.reported:
                events.append(
                    Leak(
                        step=step,
                        kind=describe(kind),
                        tensors=count,
                        per_step=round(grown / steps, 2),
                        bytes_per_step=round((sizes[kind] - before_bytes.get(kind, 0)) / steps),
                    )
                )
                self.reported.add(kind)
        return sorted(events, key=lambda e: -e.bytes_per_step)[:5]


def live_tensors() -> tuple[Counter, Counter]:
    """Count and bytes of live tensors by (shape, dtype, device, grad_fn)."""
    counts, sizes = Counter(), Counter()
    for obj in gc.get_objects():
        try:
            if not issubclass(type(obj), torch.Tensor):  # type(): isinstance trips deprecation shims
                continue
            kind = (tuple(obj.shape), str(obj.dtype), str(obj.device), type(obj.grad_fn).__name__ if obj.grad_fn is not None else None)
            counts[kind] += 1
            sizes[kind] += obj.numel() * obj.element_size()
        except (ReferenceError, RuntimeError):  # a proxy or a tensor being torn down
            continue
    return counts, sizes


def describe(kind: tuple) -> str:
    shape, dtype, device, grad_fn = kind
    text = f"{dtype.removeprefix('torch.')} {list(shape)} on {device}"
    return text + (f" with grad_fn {grad_fn} (it keeps its graph alive)" if grad_fn else "")

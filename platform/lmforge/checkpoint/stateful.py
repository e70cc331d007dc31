"""What checkpoints need of whatever they save: its format and its state. Engines
satisfy it; checkpoints know layouts and files, never an engine."""

from __future__ import annotations

from typing import Protocol

from lmforge.checkpoint.state import TrainerState


class Checkpointable(Protocol):
    # "dcp": `state_dict()` saved with torch.distributed.checkpoint; otherwise the
    # object writes and reads its own files with `save` and `load`.
    checkpoint_format: str

    def state_dict(self) -> tuple[dict, dict]:
        """dcp: (sharded tensors for DCP, the JSON-safe rest)."""
        ...

    def load_state_dict(self, tensors: dict, plain: dict) -> None: ...

    def save(self, directory: str) -> None:
        """Own format: write this rank's files into the step directory."""
        ...

    def load(self, directory: str, saved: TrainerState) -> None:
        """Own format: restore from a step directory; `saved` is its state.json."""
        ...

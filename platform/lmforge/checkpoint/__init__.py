"""Sharded checkpoints with torch.distributed.checkpoint: save, find, load, retain."""

from lmforge.checkpoint.store import CheckpointStore, CommittedCheckpoint

__all__ = ["CheckpointStore", "CommittedCheckpoint"]

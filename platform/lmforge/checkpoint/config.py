"""The job file's `checkpoint` section: where and how often checkpoints are written,
how many are kept, and how a job resumes from them."""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from lmforge.paths import LocalPath
from lmforge.section import Section


class CheckpointSpec(Section):
    dir: Optional[LocalPath] = Field(None, description="directory or fsspec URI; default <run_dir>/checkpoints")
    interval: int = Field(50, gt=0, description="save every N optimizer steps (and at the last step)")
    every_minutes: Optional[float] = Field(
        None, gt=0, description="also save once this long has passed since the last save (whichever of it and interval comes first)"
    )
    keep: int = Field(3, gt=0, description="newest committed checkpoints kept")
    keep_every: Optional[int] = Field(None, gt=0, description="also keep every checkpoint whose step is a multiple of this")
    async_save: bool = Field(True, description="write in the background; training pauses only to copy the state to CPU memory")
    in_memory: bool = Field(
        False,
        description="also keep a snapshot in host memory, on the rank's node and one other, every memory_interval steps; "
        "a restart within the job restores from it (up to 4x each rank's weights and optimizer state per rank, see `lmforge plan`)",
    )
    memory_interval: int = Field(
        5,
        gt=0,
        description="steps between in-memory snapshots (with in_memory): a failure redoes at most about this many steps; "
        "each snapshot costs the loop a copy and a serialization of the rank's state (bench/RESULTS.md)",
    )
    max_failed_writes: int = Field(3, gt=0, description="checkpoint writes that may fail in a row (logged) before the job fails")
    resume: bool = Field(True, description="continue from the latest checkpoint; false: start at 0 over an empty checkpoint.dir")
    discard_existing: bool = Field(False, description="with resume: false, delete the checkpoints checkpoint.dir holds first")
    allow_data_change: bool = Field(
        False, description="resume although the seed, shuffle window or dataset changed (a new data order; recorded as a data_changed event)"
    )

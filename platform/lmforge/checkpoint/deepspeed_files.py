"""DeepSpeed's files inside a step directory: its own checkpoint under `deepspeed/`,
and the DP-size-independent "universal" conversion beside it. The engine writes and
reads them; export consolidates them."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile

CHECKPOINT_TAG = "deepspeed"
UNIVERSAL_TAG = "universal"


def skip_shared_memory_op() -> None:
    """DeepSpeed compiles a shared-memory collective op at every start on CPU (minutes);
    lmforge's collectives go through torch.distributed, so it is not needed."""
    import deepspeed.comm.torch  # noqa: F401  (the name resolves to torch; the module is in sys.modules)

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def to_universal(step_dir: str) -> str:
    """Convert `<step_dir>/deepspeed` to DeepSpeed's DP-size-independent layout, unless
    already done; written under a temporary name and renamed, so it is whole or absent."""
    from deepspeed.checkpoint import ds_to_universal

    out = os.path.join(step_dir, UNIVERSAL_TAG)
    if os.path.isdir(out):
        return out
    staging = tempfile.mkdtemp(prefix=f".{UNIVERSAL_TAG}.", dir=step_dir)
    args = argparse.Namespace(
        input_folder=os.path.join(step_dir, CHECKPOINT_TAG),
        output_folder=staging,
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    with contextlib.redirect_stdout(io.StringIO()):  # it prints every parameter
        ds_to_universal.main(args)
    os.replace(staging, out)
    return out

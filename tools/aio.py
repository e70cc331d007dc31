"""NVMe offload's requirement: DeepSpeed's async I/O op, built against Debian's libaio.

Installs libaio-dev where its header is missing (apt, as root) and builds the op, so
ranks load it in a moment instead of compiling it at start: 150-200 s on 2 cores. torch
keeps it in its per-user extension cache, keyed by the paths it was built from (the
venv's): a later setup of the same checkout finds it (5 s), one elsewhere builds again.
Where neither can be done it says so and the NVMe tests skip with the reason; nothing
else needs the op.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HEADER = Path("/usr/include/libaio.h")


def install_libaio() -> bool:
    if HEADER.exists():
        return True
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        print("libaio-dev is not installed and apt-get cannot be run here: NVMe offload tests will skip", file=sys.stderr)
        return False
    quiet = {"stdout": subprocess.DEVNULL, "env": os.environ | {"DEBIAN_FRONTEND": "noninteractive"}}
    installed = subprocess.run(["apt-get", "update", "-qq"], **quiet).returncode == 0
    installed = installed and subprocess.run(["apt-get", "install", "-y", "-qq", "libaio-dev"], **quiet).returncode == 0
    if not installed:
        print("apt-get could not install libaio-dev (above): NVMe offload tests will skip", file=sys.stderr)
    return installed


def build_op() -> None:
    began = time.monotonic()
    code = "from deepspeed.ops.op_builder import AsyncIOBuilder; AsyncIOBuilder().load(verbose=False)"
    built = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if built.returncode != 0:
        print(f"DeepSpeed's async I/O op did not build: NVMe offload tests will skip\n{built.stderr[-2000:]}", file=sys.stderr)
        return
    print(f"DeepSpeed's async I/O op is built ({time.monotonic() - began:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    if install_libaio():
        build_op()

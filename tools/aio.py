"""NVMe offload's requirement: DeepSpeed's async I/O op, built against Debian's libaio.

Installs libaio-dev (and ccache) where missing (apt, as root) and builds the op, so
ranks load it in a moment instead of compiling it at start. A fresh venv makes torch
build it again (its sources are new files): 150-200 s of compiling on 2 cores, so the
compiler runs through ccache, which serves the same sources from its per-user cache
when the checkout's path is the one it was built at. Where libaio cannot be had it
says so and the NVMe tests skip with the reason; nothing else needs the op.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HEADER = Path("/usr/include/libaio.h")
CCACHE_COMPILERS = Path("/usr/lib/ccache")  # Debian's ccache: `c++` and `gcc` that go through it


def install_packages() -> bool:
    """libaio-dev (needed) and ccache (for speed); False where libaio cannot be had."""
    if HEADER.exists() and CCACHE_COMPILERS.exists():
        return True
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        print("libaio-dev or ccache is not installed and apt-get cannot be run here", file=sys.stderr)
        return HEADER.exists()
    quiet = {"stdout": subprocess.DEVNULL, "env": os.environ | {"DEBIAN_FRONTEND": "noninteractive"}}
    installed = subprocess.run(["apt-get", "update", "-qq"], **quiet).returncode == 0
    installed = installed and subprocess.run(["apt-get", "install", "-y", "-qq", "libaio-dev", "ccache"], **quiet).returncode == 0
    if not HEADER.exists():
        print("apt-get could not install libaio-dev (above): NVMe offload tests will skip", file=sys.stderr)
    return HEADER.exists()


def build_op() -> None:
    began = time.monotonic()
    code = "from deepspeed.ops.op_builder import AsyncIOBuilder; AsyncIOBuilder().load(verbose=False)"
    # The compiler's name stays `c++` (what the ranks' own load writes in its build file,
    # so they see nothing to rebuild); only this build finds ccache's under that name.
    env = os.environ | {"PATH": f"{CCACHE_COMPILERS}{os.pathsep}{os.environ['PATH']}"} if CCACHE_COMPILERS.exists() else None
    built = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if built.returncode != 0:
        print(f"DeepSpeed's async I/O op did not build: NVMe offload tests will skip\n{built.stderr[-2000:]}", file=sys.stderr)
        return
    print(f"DeepSpeed's async I/O op is built ({time.monotonic() - began:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    if install_packages():
        build_op()

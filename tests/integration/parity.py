"""Launch parity_worker.py under torchrun and read back the losses (and what ran)."""

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("parity_worker.py")


def losses(tmp_path, nproc, *overrides, extra=(), describe=False):
    key = hashlib.sha1(repr((overrides, tuple(extra))).encode()).hexdigest()[:12]
    out = tmp_path / f"{nproc}-{key}.json"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port),
           str(WORKER), "--out", str(out)]
    for item in overrides:
        cmd += ["--set", item]
    cmd += list(extra)
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every rank it started
        raise
    assert proc.returncode == 0, stderr[-3000:]
    result = json.loads(out.read_text())
    return (result["losses"], result["engine"]) if describe else result["losses"]

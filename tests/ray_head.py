"""A real Ray head started with `ray start --head` for the tests that use a cluster
the way users do (the job API, `ray job submit`, a notebook): private ports, temp
dir and auth token, stopped by signalling only the process group it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ports import bindable

BIN = Path(sys.executable).parent


@dataclass
class RayHead:
    address: str  # the job API (dashboard) URL
    env: dict  # what a client needs: the auth token's settings, PATH, no RAY_ADDRESS
    token: str
    metrics_port: int
    log: Path


# Ports for the head's own components and workers: below the kernel's ephemeral range
# (32768 up), so no port another process is handed by a bind to port 0 (as Ray's other
# clusters, gloo and torch's stores here get theirs) can take one between this choice
# and the head's bind; and not Ray's default worker ports (10002-19999). Each is
# probed on every address (tests/ports.py).
PRIVATE_LO, PRIVATE_HI = 20000, 32768
WORKER_PORTS = 200


def private_ports(n: int) -> tuple[list[int], int]:
    """`n` component ports and the first of `WORKER_PORTS` + 1 worker ports, all free,
    in a block of their own (where it starts derived from this process's id)."""
    size = n + WORKER_PORTS + 1
    start = PRIVATE_LO + (os.getpid() * 97) % (PRIVATE_HI - PRIVATE_LO - size)
    for _ in range((PRIVATE_HI - PRIVATE_LO) // size):
        block = range(start, start + size)
        if all(bindable(port) for port in block):
            return list(block[:n]), block[n]
        start = PRIVATE_LO + (start + size - PRIVATE_LO) % (PRIVATE_HI - PRIVATE_LO - size)
    raise AssertionError(f"no free block of {size} ports in {PRIVATE_LO}-{PRIVATE_HI}")


@contextmanager
def ray_head(log_dir: Path, num_cpus: int = 4):
    temp_dir = Path(f"/tmp/lmfh-{uuid.uuid4().hex[:8]}")
    token_path = temp_dir / "token"
    temp_dir.mkdir()
    token_path.write_text(uuid.uuid4().hex)
    env = os.environ | {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token_path),
        "RAY_TMPDIR": str(temp_dir),
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("RAY_ADDRESS", None)
    (gcs, dash, agent, agent_grpc, metrics, rt_env, client, nm, om), lo = private_ports(9)
    cmd = [
        str(BIN / "ray"),
        "start",
        "--head",
        "--block",
        "--disable-usage-stats",
        f"--num-cpus={num_cpus}",
        f"--port={gcs}",
        f"--dashboard-port={dash}",
        "--dashboard-host=127.0.0.1",
        "--include-dashboard=true",
        f"--dashboard-agent-listen-port={agent}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--metrics-export-port={metrics}",
        f"--runtime-env-agent-port={rt_env}",
        f"--ray-client-server-port={client}",
        f"--node-manager-port={nm}",
        f"--object-manager-port={om}",
        f"--min-worker-port={lo}",
        f"--max-worker-port={lo + WORKER_PORTS}",
        f"--temp-dir={temp_dir}",
    ]
    log = log_dir / "head.log"
    # Metrics reach the node's exporter every 10 s by default; tests scrape sooner.
    head = subprocess.Popen(
        cmd, env=env | {"RAY_metrics_report_interval_ms": "1000"}, start_new_session=True, stdout=open(log, "w"), stderr=subprocess.STDOUT
    )
    address = f"http://127.0.0.1:{dash}"
    try:
        wait_for_job_api(address, token_path.read_text(), head, log)
        yield RayHead(address, env, token_path.read_text(), metrics, log)
    finally:
        # The head's whole process group (GCS, raylet, dashboard, workers): nothing of
        # it is needed now, and `ray start --block` lingers on SIGTERM.
        os.killpg(head.pid, signal.SIGKILL)
        head.wait()
        subprocess.run(["rm", "-rf", str(temp_dir)])


def wait_for_job_api(address: str, token: str, head: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    """Until the head's job API answers (an HTTP request with the cluster's token,
    not a `ray job list` process per try: each of those costs a second of CPU)."""
    request = urllib.request.Request(f"{address}/api/jobs/", headers={"Authorization": f"Bearer {token}"})
    deadline, last = time.time() + timeout_s, None
    while True:
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                if response.status == 200:
                    return
                last = f"HTTP {response.status}"
        except OSError as err:  # refused while starting, or an HTTP error
            last = err
        assert head.poll() is None, log.read_text()
        assert time.time() < deadline, f"the job API at {address} did not answer within {timeout_s:.0f}s: {last}"
        time.sleep(0.25)

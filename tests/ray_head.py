"""A real Ray head started with `ray start --head` for the tests that use a cluster
the way users do (the job API, `ray job submit`, a notebook): private ports, temp
dir and auth token, stopped by signalling only the process group it started."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

BIN = Path(sys.executable).parent


@dataclass
class RayHead:
    address: str  # the job API (dashboard) URL
    env: dict  # what a client needs: the auth token's settings, PATH, no RAY_ADDRESS
    token: str
    metrics_port: int
    log: Path


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


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
    gcs, dash, agent, agent_grpc, metrics, rt_env, client, nm, om = free_ports(9)
    lo = 20000 + (os.getpid() * 97) % 30000
    while any(lo <= port <= lo + 200 for port in (gcs, dash, agent, agent_grpc, metrics, rt_env, client, nm, om)):
        lo += 211  # the worker port range must not hold a port given to another component
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
        f"--max-worker-port={lo + 200}",
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

"""A real S3-compatible server for the object-storage tests: moto's server mode, on a
private port, in its own process group (stopped by signalling only that group).

The S3 settings go into the environment when the test session starts, before Ray
does, so every rank and Ray Data task finds its credentials the way a user's job
would: from the environment, never from the job file.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path


BUCKET = "lmforge-tests"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def s3_environment() -> dict:
    """Where the server will listen, and the (moto-accepted) credentials."""
    return {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{_free_port()}",
        "AWS_ACCESS_KEY_ID": "lmforge-test-key",
        "AWS_SECRET_ACCESS_KEY": "lmforge-test-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",  # no instance-role lookups against a network that is not there
    }


@contextmanager
def s3_server(log: Path):
    """Runs moto's server at $AWS_ENDPOINT_URL with one bucket, `BUCKET`."""
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    port = endpoint.rsplit(":", 1)[1]
    with open(log, "wb") as out:
        server = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", port],
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 30
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=1).read()
                break
            except OSError:
                if time.time() > deadline or server.poll() is not None:
                    raise RuntimeError(f"moto's S3 server did not start; see {log}")
                time.sleep(0.2)
        import fsspec

        fsspec.filesystem("s3", skip_instance_cache=True).mkdir(BUCKET)
        yield f"s3://{BUCKET}"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=10)

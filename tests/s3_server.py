"""A real S3-compatible server for the object-storage tests: moto's server mode, on a
private port, in its own process group (stopped by signalling only that group).

The S3 settings go into the environment when the test session starts, before Ray
does, so every rank and Ray Data task finds its credentials the way a user's job
would: from the environment, never from the job file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from ports import free_port

BUCKET = "lmforge-tests"


def free_endpoint() -> str:
    return f"http://127.0.0.1:{free_port()}"


def s3_environment() -> dict:
    """Where the server will listen, and the (moto-accepted) credentials."""
    return {
        "AWS_ENDPOINT_URL": free_endpoint(),
        "AWS_ACCESS_KEY_ID": "lmforge-test-key",
        "AWS_SECRET_ACCESS_KEY": "lmforge-test-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",  # no instance-role lookups against a network that is not there
    }


@contextmanager
def s3_server(log: Path, endpoint: str = "", deny_all: bool = False):
    """Runs moto's server at `endpoint` (default: $AWS_ENDPOINT_URL) with one bucket,
    `BUCKET`. `deny_all`: it checks credentials, and knows none, so every request is denied
    (and the bucket is not made)."""
    endpoint = endpoint or os.environ["AWS_ENDPOINT_URL"]
    port = endpoint.rsplit(":", 1)[1]
    env = os.environ | ({"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if deny_all else {})
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", port],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    try:
        deadline = time.time() + 30
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=1).read()
                break
            except urllib.error.HTTPError:
                break  # it answers (a server checking credentials refuses the anonymous probe)
            except OSError:
                if time.time() > deadline or server.poll() is not None:
                    raise RuntimeError(f"moto's S3 server did not start; see {log}") from None
                time.sleep(0.2)
        import fsspec

        if not deny_all:  # (denied too: authorization comes first)
            fsspec.filesystem("s3", skip_instance_cache=True, endpoint_url=endpoint).mkdir(BUCKET)
        yield f"s3://{BUCKET}"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=10)

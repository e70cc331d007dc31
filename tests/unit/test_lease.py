"""One driver per job: the run directory's lease, held by another real process."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from lmforge.errors import UserError
from lmforge.lease import LEASE_FILE, JobLease

HOLDER = """
import sys, time
from lmforge.lease import JobLease
JobLease(sys.argv[1], "tiny", heartbeat_s=0.2).acquire()
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
    """Another driver process holding the job's lease."""
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    yield process
    process.kill()
    process.wait()


def test_a_second_driver_is_refused_naming_the_first(holder, tmp_path):
    with pytest.raises(UserError, match=rf"^name: job tiny is already being trained by pid {holder.pid} on {os.uname().nodename}"):
        JobLease(tmp_path / "run", "tiny").acquire()
    beat = json.loads((tmp_path / "run" / LEASE_FILE).read_text())["heartbeat"]
    time.sleep(0.6)
    assert json.loads((tmp_path / "run" / LEASE_FILE).read_text())["heartbeat"] > beat  # renewed while it runs


def test_a_killed_drivers_lease_is_taken_over_at_once(holder, tmp_path):
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with JobLease(tmp_path / "run", "tiny") as lease:  # its pid is gone on this host: no wait for the lease to expire
        assert json.loads(lease.path.read_text())["pid"] == os.getpid()
    assert not (tmp_path / "run" / LEASE_FILE).exists()


def test_another_hosts_lease_holds_until_its_heartbeat_is_stale(tmp_path):
    (tmp_path / "run").mkdir()
    lease_file = tmp_path / "run" / LEASE_FILE
    record = {"job": "tiny", "host": "elsewhere", "pid": 1, "started": time.time(), "token": "theirs"}
    lease_file.write_text(json.dumps(record | {"heartbeat": time.time()}))
    with pytest.raises(UserError, match="pid 1 on elsewhere"):
        JobLease(tmp_path / "run", "tiny", lease_s=30).acquire()
    lease_file.write_text(json.dumps(record | {"heartbeat": time.time() - 31}))
    with JobLease(tmp_path / "run", "tiny", lease_s=30):
        assert json.loads(lease_file.read_text())["host"] == os.uname().nodename


def test_a_job_refused_at_once_leaves_no_run_directory(tmp_path):
    with JobLease(tmp_path / "runs" / "tiny", "tiny"):
        assert (tmp_path / "runs" / "tiny" / LEASE_FILE).exists()
    assert not (tmp_path / "runs").exists()


def test_a_driver_whose_lease_was_taken_over_is_told_to_stop(tmp_path):
    from lmforge.errors import TrainingFailed

    with JobLease(tmp_path / "run", "tiny", heartbeat_s=0.05) as lease:
        lease.check()  # still its own
        other = {"job": "tiny", "host": "elsewhere", "pid": 7, "started": time.time(), "heartbeat": time.time(), "token": "theirs"}
        lease.path.write_text(json.dumps(other))  # as a driver that found this one stale would
        time.sleep(0.3)
        with pytest.raises(TrainingFailed, match="taken over by pid 7 on elsewhere"):
            lease.check()
    assert json.loads((tmp_path / "run" / LEASE_FILE).read_text())["token"] == "theirs"  # not released: not its own

"""One driver per checkpoint directory: the lease, held by another real process;
another job's checkpoints refused; two drivers racing for it, one winner."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from lmforge.errors import UserError
from lmforge.lease import JobLease

HOLDER = """
import sys, time
from lmforge.lease import JobLease
JobLease(sys.argv[1], sys.argv[2], heartbeat_s=0.2).acquire()
print("held", flush=True)
time.sleep(600)
"""


def lease_files(directory) -> list:
    return sorted(p for p in directory.iterdir() if p.name.startswith("driver.lease."))


def record(directory) -> dict:
    (newest,) = lease_files(directory)[-1:]
    return json.loads(newest.read_text())


def start_holder(directory, job: str = "tiny") -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory), job], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    return process


@pytest.fixture
def holder(tmp_path):
    """Another driver process holding the job's lease."""
    process = start_holder(tmp_path / "ckpt")
    yield process
    process.kill()
    process.wait()


def test_a_second_driver_is_refused_naming_the_first(holder, tmp_path):
    with pytest.raises(UserError, match=rf"^name: job tiny is already being trained by pid {holder.pid} on {os.uname().nodename}"):
        JobLease(tmp_path / "ckpt", "tiny").acquire()
    beat = record(tmp_path / "ckpt")["heartbeat"]
    time.sleep(0.6)
    assert record(tmp_path / "ckpt")["heartbeat"] > beat  # renewed while it runs


def test_another_job_on_the_same_checkpoints_is_refused_naming_it(holder, tmp_path):
    with pytest.raises(UserError, match=rf"^checkpoint.dir: {tmp_path / 'ckpt'} is in use by job tiny, trained by pid {holder.pid}"):
        JobLease(tmp_path / "ckpt", "other").acquire()


def test_a_killed_drivers_lease_is_taken_over_at_once(holder, tmp_path):
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with JobLease(tmp_path / "ckpt", "tiny"):  # its pid is gone on this host: no wait for the lease to expire
        assert record(tmp_path / "ckpt")["pid"] == os.getpid()
        assert len(lease_files(tmp_path / "ckpt")) == 1  # the dead holder's generation is cleared
    assert not lease_files(tmp_path / "ckpt")


def test_another_hosts_lease_holds_until_its_heartbeat_is_stale(tmp_path):
    (tmp_path / "ckpt").mkdir()
    lease_file = tmp_path / "ckpt" / "driver.lease.00000001"
    theirs = {"job": "tiny", "host": "elsewhere", "pid": 1, "started": time.time(), "token": "theirs"}
    lease_file.write_text(json.dumps(theirs | {"heartbeat": time.time()}))
    with pytest.raises(UserError, match="pid 1 on elsewhere"):
        JobLease(tmp_path / "ckpt", "tiny", lease_s=30).acquire()
    lease_file.write_text(json.dumps(theirs | {"heartbeat": time.time() - 31}))
    with JobLease(tmp_path / "ckpt", "tiny", lease_s=30):
        assert record(tmp_path / "ckpt")["host"] == os.uname().nodename


def test_a_lease_file_being_written_is_not_free(tmp_path):
    """An empty or half-read lease is someone's: it holds until its age says it is stale."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "driver.lease.00000001").write_text("")
    with pytest.raises(UserError, match="is in use by job"):
        JobLease(tmp_path / "ckpt", "tiny").acquire()
    old = time.time() - 60
    os.utime(tmp_path / "ckpt" / "driver.lease.00000001", (old, old))
    with JobLease(tmp_path / "ckpt", "tiny"):
        pass


def test_of_drivers_racing_for_a_lease_exactly_one_wins(tmp_path):
    """A free lease and a stale one, each raced for by 8 threads released at once, 20 times."""
    for trial in range(20):
        directory = tmp_path / f"race-{trial}"
        if trial % 2:
            directory.mkdir()
            stale = {"job": "tiny", "host": "elsewhere", "pid": 1, "started": 0, "heartbeat": 0, "token": "gone"}
            (directory / "driver.lease.00000003").write_text(json.dumps(stale))
        start, winners, leases = threading.Barrier(8), [], []

        def race():
            lease = JobLease(directory, "tiny", heartbeat_s=60)
            start.wait()
            try:
                lease.acquire()
                winners.append(lease)
            except UserError:
                pass
            leases.append(lease)

        threads = [threading.Thread(target=race) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(winners) == 1, trial
        for lease in leases:
            lease.release()


def test_a_job_refused_at_once_leaves_no_directory(tmp_path):
    with JobLease(tmp_path / "runs" / "tiny" / "checkpoints", "tiny"):
        assert lease_files(tmp_path / "runs" / "tiny" / "checkpoints")
    assert not (tmp_path / "runs").exists()


def test_a_driver_whose_lease_was_taken_over_is_told_to_stop(tmp_path):
    from lmforge.errors import TrainingFailed

    with JobLease(tmp_path / "ckpt", "tiny", heartbeat_s=0.05) as lease:
        lease.check()  # still its own
        other = {"job": "tiny", "host": "elsewhere", "pid": 7, "started": time.time(), "heartbeat": time.time(), "token": "theirs"}
        (tmp_path / "ckpt" / f"driver.lease.{lease.generation + 1:08d}").write_text(json.dumps(other))  # as a driver that found it stale would
        time.sleep(0.3)
        with pytest.raises(TrainingFailed, match="taken over by pid 7 on elsewhere"):
            lease.check()
    assert record(tmp_path / "ckpt")["token"] == "theirs"  # not released: not its own


def test_a_lease_on_an_object_store_has_one_holder(s3_bucket):
    """The lease where the checkpoints are, on S3: a conditional put (If-None-Match) decides a race."""
    where, winners = f"{s3_bucket}/leased-checkpoints", []
    start = threading.Barrier(4)

    def race(job):
        lease = JobLease(where, job, heartbeat_s=60)
        start.wait()
        try:
            lease.acquire()
            winners.append(lease)
        except UserError as err:
            assert "is in use by job" in str(err) or "already being trained" in str(err)

    threads = [threading.Thread(target=race, args=(f"job-{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(winners) == 1
    winners[0].release()
    with JobLease(where, "next"):
        pass

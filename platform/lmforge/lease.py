"""One driver per job: a lease file in the run directory, with its holder's host and
pid, renewed by a heartbeat. A second driver of the same job is refused; a lease
whose holder died (its pid gone on this host) or whose heartbeat went stale is
taken over, so a dead driver blocks a resubmission for at most the lease's length.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from lmforge.errors import TrainingFailed, UserError

LEASE_FILE = "driver.lease"
LEASE_S = 30.0  # a heartbeat this old means its driver is gone
HEARTBEAT_S = 5.0


class JobLease:
    def __init__(self, run_dir: str | os.PathLike, job: str, lease_s: float = LEASE_S, heartbeat_s: float = HEARTBEAT_S):
        self.path = Path(run_dir) / LEASE_FILE
        self.job, self.lease_s, self.heartbeat_s = job, lease_s, heartbeat_s
        self.token, self.started = uuid.uuid4().hex, time.time()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._made: list[Path] = []  # directories acquire() created, innermost first
        self.taken_by: dict | None = None  # set when another driver took the lease over

    def __enter__(self) -> "JobLease":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the lease, or raise UserError naming the driver that holds it."""
        self._made = [p for p in (self.path.parent, *self.path.parent.parents) if not p.exists()]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self._create():
            holder = self._read()
            if holder is not None and self._alive(holder):
                age = time.time() - holder["heartbeat"]
                raise UserError(
                    f"name: job {self.job} is already being trained by pid {holder['pid']} on {holder['host']} "
                    f"(since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder['started']))}, heartbeat {age:.0f}s ago; "
                    f"lease {self.path}); wait for it to finish or stop it, or give this job another name"
                )
            self._write()  # its holder is gone: take it over
        self._beat = threading.Thread(target=self._renew, name="job-lease", daemon=True)
        self._beat.start()

    def check(self) -> None:
        """Raise TrainingFailed once another driver has taken the job over."""
        if self.taken_by is not None:
            raise TrainingFailed(f"the job's lease ({self.path}) was taken over by pid {self.taken_by.get('pid')} on "
                                 f"{self.taken_by.get('host')} after this driver missed its heartbeats; that driver runs the job now")

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=self.heartbeat_s)
        holder = self._read()
        if holder is not None and holder.get("token") == self.token:
            self.path.unlink(missing_ok=True)
        for made in self._made:  # a job refused at once leaves no run directory behind
            try:
                made.rmdir()
            except OSError:
                break  # holds the run's files

    def _record(self) -> dict:
        return {"job": self.job, "host": socket.gethostname(), "pid": os.getpid(), "started": self.started,
                "heartbeat": time.time(), "token": self.token}

    def _create(self) -> bool:
        """Atomically create the lease file; False when one exists."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as out:
            json.dump(self._record(), out)
        return True

    def _write(self) -> None:
        staging = self.path.with_name(f".{LEASE_FILE}.{self.token}")
        staging.write_text(json.dumps(self._record()))
        os.replace(staging, self.path)

    def _read(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None  # gone, or being replaced: treated as free

    def _alive(self, holder: dict) -> bool:
        if time.time() - holder.get("heartbeat", 0) > self.lease_s:
            return False
        if holder.get("host") == socket.gethostname():
            try:
                os.kill(int(holder["pid"]), 0)
            except ProcessLookupError:
                return False  # died on this host: no need to wait out its lease
            except PermissionError:
                return True
        return True

    def _renew(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            holder = self._read()
            if holder is not None and holder.get("token") != self.token:
                self.taken_by = holder  # this driver stalled past its lease and another took the job
                return
            self._write()

"""One driver per checkpoint directory: a lease held where the checkpoints are (a
local directory or an object store), so two jobs never write, prune or set aside
each other's steps. The lease is a series of generation files; taking it is the
exclusive creation of the next one (a hard link locally, a conditional put on S3),
so of two drivers racing for it exactly one wins. Its holder renews it by a
heartbeat; a holder that died (its pid gone on this host) or went stale is
replaced by a new generation, and finds out at its next heartbeat.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
import uuid

import fsspec
from fsspec.implementations.local import LocalFileSystem

from lmforge.errors import TrainingFailed, UserError

LEASE_PREFIX = "driver.lease."
GENERATION = re.compile(r"^driver\.lease\.(\d{8})$")
LEASE_S = 30.0  # a heartbeat this old means its driver is gone
HEARTBEAT_S = 5.0
TRIES = 3  # generations lost to a racing driver before giving up (each loss re-reads the winner)


class JobLease:
    def __init__(
        self, location: str | os.PathLike, job: str, lease_s: float = LEASE_S, heartbeat_s: float = HEARTBEAT_S, field: str = "checkpoint.dir"
    ):
        self.location, self.job, self.field = str(location), job, field
        self.lease_s, self.heartbeat_s = lease_s, heartbeat_s
        self.fs, self.root = fsspec.core.url_to_fs(self.location, use_listings_cache=False)
        self.local = isinstance(self.fs, LocalFileSystem)
        self.token, self.started = uuid.uuid4().hex, time.time()
        self.generation: int | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._made: list[str] = []  # local directories acquire() created, innermost first
        self.taken_by: dict | None = None  # set when another driver took the lease over

    @property
    def path(self) -> str:
        """The file this driver holds the lease by."""
        return self._file(self.generation or 0)

    def __enter__(self) -> "JobLease":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the lease, or raise UserError naming the driver that holds it."""
        if self.local:
            self._made = _missing_parents(self.root)
            os.makedirs(self.root, exist_ok=True)
        for _ in range(TRIES):
            generation, holder = self._newest()
            if holder is not None and self._alive(holder):
                self.release()
                raise UserError(self._refusal(holder))
            if self._create(generation + 1):
                self.generation = generation + 1
                self._remove_older()
                self._beat = threading.Thread(target=self._renew, name="job-lease", daemon=True)
                self._beat.start()
                return
        self.release()
        raise UserError(f"{self.field}: {self.location}: other drivers kept taking its lease; try again")

    def check(self) -> None:
        """Raise TrainingFailed once another driver has taken the job over."""
        if self.taken_by is not None:
            raise TrainingFailed(
                f"the job's lease ({self.path}) was taken over by pid {self.taken_by.get('pid')} on "
                f"{self.taken_by.get('host')} after this driver missed its heartbeats; that driver runs the job now"
            )

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=self.heartbeat_s)
        if self.generation is not None and self.taken_by is None and self._newest()[0] == self.generation:
            self._remove(self.path)
        for made in self._made:  # a job refused at once leaves no directory behind
            try:
                os.rmdir(made)
            except OSError:
                break  # holds the run's files

    def _refusal(self, holder: dict) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
        who = f"pid {holder.get('pid')} on {holder.get('host')} (since {since}, heartbeat {time.time() - holder.get('heartbeat', 0):.0f}s ago)"
        if holder.get("job") == self.job:
            return (
                f"name: job {self.job} is already being trained by {who}; lease in {self.location}; "
                f"wait for it to finish or stop it, or give this job another name"
            )
        return (
            f"{self.field}: {self.location} is in use by job {holder.get('job')}, trained by {who}; give this job a checkpoint directory of its own"
        )

    def _file(self, generation: int) -> str:
        return f"{self.root.rstrip('/')}/{LEASE_PREFIX}{generation:08d}"

    def _generations(self) -> list[int]:
        try:
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for name in names if (m := GENERATION.match(name)))

    def _newest(self) -> tuple[int, dict | None]:
        """The newest generation and its record (None when there is none)."""
        generations = self._generations()
        if not generations:
            return 0, None
        newest = generations[-1]
        try:
            return newest, json.loads(self.fs.cat_file(self._file(newest)))
        except FileNotFoundError:
            return newest, None  # released meanwhile
        except (OSError, ValueError):
            # Unreadable is not free: its holder may be writing it. It holds until its age says it is stale.
            return newest, {"job": "?", "host": "?", "pid": "?", "heartbeat": self._modified(newest)}

    def _modified(self, generation: int) -> float:
        try:
            return self.fs.modified(self._file(generation)).timestamp()
        except (OSError, ValueError, NotImplementedError):
            return time.time()

    def _alive(self, holder: dict) -> bool:
        if time.time() - float(holder.get("heartbeat", 0)) > self.lease_s:
            return False
        if holder.get("host") == socket.gethostname():
            try:
                os.kill(int(holder["pid"]), 0)
            except ProcessLookupError:
                return False  # died on this host: no need to wait out its lease
            except (PermissionError, ValueError, KeyError):
                return True
        return True

    def _record(self) -> bytes:
        return json.dumps(
            {
                "job": self.job,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "started": self.started,
                "heartbeat": time.time(),
                "token": self.token,
            }
        ).encode()

    def _create(self, generation: int) -> bool:
        """Create generation `generation`'s file, whole, only if no one has: False when another did."""
        path = self._file(generation)
        try:
            if self.local:
                staging = f"{path}.{self.token}"
                with open(staging, "wb") as out:
                    out.write(self._record())
                try:
                    os.link(staging, path)  # atomic, and fails if the name exists
                finally:
                    os.unlink(staging)
            else:
                self.fs.pipe_file(path, self._record(), mode="create")  # S3: a put with If-None-Match: *
        except FileExistsError:
            return False
        return True

    def _write(self) -> None:
        if self.local:
            staging = f"{self.path}.{self.token}"
            with open(staging, "wb") as out:
                out.write(self._record())
            os.replace(staging, self.path)
        else:
            self.fs.pipe_file(self.path, self._record())

    def _remove_older(self) -> None:
        for generation in self._generations():
            if generation < (self.generation or 0):
                self._remove(self._file(generation))

    def _remove(self, path: str) -> None:
        try:
            self.fs.rm_file(path)
        except (OSError, ValueError):
            pass

    def _renew(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            newest, holder = self._newest()
            if newest > (self.generation or 0):
                self.taken_by = holder or {}  # this driver stalled past its lease and another took the job
                return
            self._write()


def _missing_parents(path: str) -> list[str]:
    """`path` and its parents that do not exist yet, innermost first."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing

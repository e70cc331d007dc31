"""`JobHandle`: one submitted job, seen from the client. Its logs carry the driver's
event stream (one `lmforge-event` JSON line per step and event, then the summary),
so that metrics, plots and the summary need nothing but the job API."""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
from typing import Iterator, Optional

from lmforge.errors import TrainingFailed
from lmforge.events import EVENT_PREFIX
from lmforge.jobs.connection import TERMINAL, translated
from lmforge.tracking.summary import RunSummary


class JobTimeout(TimeoutError):
    """`JobHandle.wait` ran out of time; the job goes on."""


class JobHandle:
    def __init__(self, job_id: str, client):
        self.id, self.client = job_id, client
        self.address = client.get_address()
        self.info()  # an unknown id fails here, not at first use

    def __repr__(self) -> str:
        return f"JobHandle({self.id!r}, {self.address})"

    def info(self):
        """Ray's `JobDetails` of the job."""
        with translated(self.address, self.id):
            return self.client.get_job_info(self.id)

    def status(self) -> str:
        """PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED."""
        status = self.info().status
        return str(getattr(status, "value", status))

    def logs(self, follow: bool = False, events: bool = False, out=None) -> str:
        """The job's output so far (`follow`: written to `out`, default stdout, as it
        comes, until the job ends). Event lines are left out unless `events`;
        terminal escape codes always are."""
        if not follow:
            with translated(self.address, self.id):
                text = self.client.get_job_logs(self.id)
            return "".join(line for line in _plain_lines(text) if events or not line.startswith(EVENT_PREFIX))
        out = out or sys.stdout
        kept = []
        for line in self._tail():
            if events or not line.startswith(EVENT_PREFIX):
                kept.append(line)
                out.write(line)
                out.flush()
        return "".join(kept)

    def follow(self, out=None) -> str:
        """Show the job's progress as it runs (plain lines: live text in a notebook),
        until it ends; returns its final status."""
        self.logs(follow=True, out=out)
        return self.wait()

    def wait(self, timeout: Optional[float] = None, poll_s: float = 1.0) -> str:
        """Until the job ends; its final status. A failed job raises `TrainingFailed`
        with the driver's own error line; `timeout` raises `JobTimeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (status := self.status()) not in TERMINAL:
            if deadline is not None and time.monotonic() > deadline:
                raise JobTimeout(f"job {self.id} is still {status} after {timeout:g}s")
            time.sleep(poll_s)
        if status == "FAILED":
            raise TrainingFailed(f"job {self.id} failed: {self._error_line() or self.info().message}")
        return status

    def stop(self) -> bool:
        """Ask the cluster to stop the job (its driver gets SIGTERM, then SIGKILL);
        False if it had already ended."""
        with translated(self.address, self.id):
            return self.client.stop_job(self.id)

    def rows(self) -> list[dict]:
        """The driver's event stream so far: steps (no `event` key), events, summary."""
        import json

        return [json.loads(line[len(EVENT_PREFIX) :]) for line in _plain_lines(self.logs(events=True)) if line.startswith(EVENT_PREFIX)]

    def metrics(self):
        """The run's step and event rows as a pandas DataFrame, one row each, in order;
        `event` is "step" for a step's row."""
        import pandas as pd

        rows = [row for row in self.rows() if row.get("event") != "summary"]
        frame = pd.DataFrame([{"event": "step", **row} if "event" not in row else row for row in rows])
        return frame if len(frame) else pd.DataFrame(columns=["event", "step"])

    def summary(self) -> Optional[RunSummary]:
        """What `lmforge train` returns, once the job has finished; else None."""
        done = [row for row in self.rows() if row.get("event") == "summary"]
        return RunSummary.model_validate(done[-1]) if done else None

    def plot(self, path: Optional[str] = None):
        """Loss, held-out loss and tokens/s by step on one figure, with failures,
        recoveries and resizes marked; shown inline in a notebook. `path`: also save it."""
        from lmforge.jobs.plot import plot_metrics

        figure = plot_metrics(self.metrics(), title=self.id)
        if path:
            figure.savefig(path, dpi=100, bbox_inches="tight")
        return figure

    def _error_line(self) -> Optional[str]:
        lines = [line.strip() for line in self.logs().splitlines() if line.startswith("lmforge: ")]
        return lines[-1].removeprefix("lmforge: ") if lines else None

    def _tail(self) -> Iterator[str]:
        """The job's log lines as they come: Ray's websocket tail, read on a thread
        with its own event loop (a notebook's kernel already runs one)."""
        chunks: queue.Queue = queue.Queue()
        done = object()

        async def pump():
            async for chunk in self.client.tail_job_logs(self.id):
                chunks.put(chunk)

        def run():
            try:
                with translated(self.address, self.id):
                    asyncio.run(pump())
            except BaseException as err:  # noqa: BLE001 - handed to the reading side
                chunks.put(err)
            chunks.put(done)

        threading.Thread(target=run, daemon=True, name=f"tail-{self.id}").start()
        pending = ""
        while (chunk := chunks.get()) is not done:
            if isinstance(chunk, BaseException):
                raise chunk
            pending += chunk
            *whole, pending = pending.split("\n")
            for line in whole:
                yield from _plain_lines(line + "\n")
        if pending:
            yield from _plain_lines(pending)


def _plain_lines(text: str) -> list[str]:
    """Lines without terminal escape codes (a driver that thought it had a terminal)."""
    from rich.text import Text

    return [Text.from_ansi(line.rstrip("\n")).plain + ("\n" if line.endswith("\n") else "") for line in text.splitlines(keepends=True)]

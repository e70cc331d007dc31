"""TensorBoard beside MLflow (`tracking.tensorboard: DIR`): the scalars the MLflow run
gets, step by step, written with TensorBoard's own event writer (neither torch nor
TensorFlow in the driver). Steps retrained after a restart replace the first ones,
through the purge TensorBoard's readers apply at a session restart."""

from __future__ import annotations

import importlib.util
import os
import time
from typing import Optional

from lmforge.errors import UserError

FLUSH_S = 2.0  # as often as the MLflow run is written


class TensorBoardLog:
    """One event file per driver in the job's TensorBoard directory."""

    def __init__(self, log_dir: str, start_step: int):
        """`start_step`: the step a resumed job restarts after (0 for a new one)."""
        check_tensorboard(log_dir)
        try:
            os.makedirs(log_dir, exist_ok=True)
        except OSError as err:
            raise UserError(f"tracking.tensorboard: cannot create {log_dir} ({err.strerror})") from None
        # TensorBoard is optional (lmforge[tensorboard]): loaded where a job asks for it.
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = event_pb2, summary_pb2
        self._writer = EventFileWriter(log_dir, flush_secs=FLUSH_S)
        if start_step:
            self.rewind(start_step)

    def scalars(self, values: dict[str, float], step: int, wall_time: Optional[float] = None) -> None:
        if values:
            Summary = self._summary.Summary
            summary = Summary(value=[Summary.Value(tag=tag, simple_value=value) for tag, value in values.items()])
            self._writer.add_event(self._event.Event(step=step, wall_time=wall_time or time.time(), summary=summary))

    def rewind(self, step: int) -> None:
        """Steps after `step` are trained again: a reader drops what was written for them
        (a session restart at `step + 1` purges every event from that step on)."""
        start = self._event.SessionLog(status=self._event.SessionLog.START)
        self._writer.add_event(self._event.Event(step=step + 1, wall_time=time.time(), session_log=start))

    def close(self) -> None:
        self._writer.close()


def check_tensorboard(log_dir: str) -> None:
    """Pre-flight (writes nothing): TensorBoard's writer is installed and `log_dir` is
    not a file."""
    if importlib.util.find_spec("tensorboard") is None:
        raise UserError("tracking.tensorboard: needs the tensorboard package (pip install 'lmforge[tensorboard]')")
    if os.path.exists(log_dir) and not os.path.isdir(log_dir):
        raise UserError(f"tracking.tensorboard: {log_dir} is a file, not a directory")

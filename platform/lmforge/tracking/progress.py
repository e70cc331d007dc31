"""What the driver shows while a job runs: a live rich progress bar on a terminal,
plain periodic lines elsewhere (job logs, CI), plus the rank layout table."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from lmforge.console import plain, text_column, text_console
from lmforge.events import Eval, Step


class ProgressView:
    def __init__(self, total_steps: int, start_step: int, console: Console | None = None, enabled: bool = True):
        self.console = console or text_console()
        self.total, self.enabled = total_steps, enabled
        self.live = enabled and self.console.is_terminal
        self.every = max(1, total_steps // 20)
        self._last_line = 0.0
        self._recent: list[float] = []
        self._eval = ""
        self.progress = None
        if self.live:
            self.progress = Progress(
                text_column("step {task.completed}/{task.total}", bold=True),
                BarColumn(),
                text_column("loss {task.fields[loss]}"),
                text_column("{task.fields[eval]}"),
                text_column("{task.fields[tps]} tok/s"),
                TimeElapsedColumn(),
                text_column("ETA"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, loss="-", eval="", tps="-")

    def __enter__(self):
        if self.progress:
            self.progress.start()
        return self

    def __exit__(self, *exc):
        if self.progress:
            self.progress.stop()
        return False

    def print(self, message: str) -> None:
        if self.enabled:
            self.console.print(plain(message), highlight=False, soft_wrap=True)

    def layout(self, ranks: list[dict]) -> None:
        if not self.enabled:
            return
        table = Table(title=plain("ranks"), show_edge=False)
        columns = ("rank", "pp", "dp", "tp", "node", "ip")
        for column in columns:
            table.add_column(column)
        for r in ranks:
            table.add_row(*(plain(r[c]) for c in columns))
        self.console.print(table)

    def held_out(self, event: Eval) -> None:
        """Shown with every step after it, until the next evaluation."""
        self._eval = f"eval {event.eval_loss:.4f}"
        if self.progress:
            self.progress.update(self.task, eval=self._eval)

    def step(self, event: Step) -> None:
        if not self.enabled:
            return
        loss, tps = f"{event.loss:.4f}", f"{event.tokens_per_s:,.0f}"
        if self.progress:
            self.progress.update(self.task, completed=event.step, loss=loss, tps=tps)
            return
        now = time.time()
        self._recent.append(event.step_time)
        if event.step % self.every == 0 or event.step == self.total or now - self._last_line > 30:
            self._last_line = now
            window = self._recent[-20:]
            eta = (self.total - event.step) * sum(window) / len(window)
            bubble = f"  bubble {event.bubble:.0%} (theory {event.bubble_theory or 0:.0%})" if event.bubble is not None else ""
            self.console.print(
                plain(
                    f"step {event.step}/{self.total}  loss {loss}  {self._eval + '  ' if self._eval else ''}lr {event.lr:.2e}  "
                    f"{tps} tok/s  data wait {event.data_wait * 1000:.1f} ms{bubble}  ETA {_clock(eta)}"
                ),
                highlight=False,
                soft_wrap=True,
            )


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"

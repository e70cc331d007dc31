"""The driver's plain progress lines (job logs, CI): the latest held-out loss rides along."""

import io

from rich.console import Console

from lmforge.tracking.progress import ProgressView


def step(n: int) -> dict:
    return {"step": n, "loss": 5.0, "lr": 1e-3, "tokens_per_s": 1000.0, "step_time": 0.1, "data_wait": 0.0}


def test_step_lines_carry_the_latest_held_out_loss():
    out = io.StringIO()
    view = ProgressView(10, 0, console=Console(file=out, force_terminal=False, width=300))
    view.step(step(1))
    view.held_out({"step": 2, "eval_loss": 4.56789})
    view.step(step(2))
    view.held_out({"step": 3, "eval_loss": 4.1})
    view.step(step(3))
    lines = out.getvalue().splitlines()
    assert "eval" not in lines[0]
    assert "loss 5.0000  eval 4.5679  lr" in lines[1] and "eval 4.1000" in lines[2]

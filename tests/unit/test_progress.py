"""The driver's plain progress lines (job logs, CI): the latest held-out loss rides along."""

import io

from rich.console import Console

from lmforge.events import EVENT_TYPES, Eval, Event, Step, parse_event
from lmforge.tracking.progress import ProgressView


def step(n: int) -> Step:
    return Step(step=n, loss=5.0, lr=1e-3, grad_norm=1.0, tokens_per_s=1000.0, step_time=0.1, data_wait=0.0, tokens=n * 64, samples_consumed=n)


def held_out(n: int, loss: float) -> Eval:
    return Eval(step=n, eval_loss=loss, eval_ppl=2.0, batches=1, seconds=0.1)


def test_step_lines_carry_the_latest_held_out_loss():
    out = io.StringIO()
    view = ProgressView(10, 0, console=Console(file=out, force_terminal=False, width=300))
    view.step(step(1))
    view.held_out(held_out(2, 4.56789))
    view.step(step(2))
    view.held_out(held_out(3, 4.1))
    view.step(step(3))
    lines = out.getvalue().splitlines()
    assert "eval" not in lines[0]
    assert "loss 5.0000  eval 4.5679  lr" in lines[1] and "eval 4.1000" in lines[2]


# One event of every kind the console describes; each string field gets text that
# rich would read as a closing tag (gloo's errors hold paths like "[/…/pair.cc:553]").
MARKUP = "[/x] [bold]"
EVENTS = {
    "spares": {"ready": 1, "wanted": 2},
    "checkpoint": {"step": 3, "path": MARKUP, "seconds": 1.0, "stall_seconds": 0.1},
    "checkpoint_failed": {"step": 3, "failed_in_a_row": 1, "max_failed_writes": 3, "error": MARKUP, "ranks": [0]},
    "checkpoint_corrupt": {"step": 3, "path": MARKUP, "reason": MARKUP},
    "data_changed": {"step": 3, "path": MARKUP, "changes": {"seed": (MARKUP, MARKUP)}},
    "restored": {"step": 3, "path": MARKUP, "from_memory": False},
    "grow_pending": {"to_dp": 2, "dp": 1},
    "resized": {"from_dp": 1, "dp": 2, "step": 3, "seconds": 1.0},
    "failure": {"attempt": 1, "max_failures": 2, "step": 3, "cause": MARKUP, "rank": 0, "nodes_lost": [MARKUP]},
    "recovered": {"step": 3, "seconds": 1.0, "dp": 1, "steps_redone": 2, "nodes_lost": [MARKUP]},
    "nonfinite": {"step": 3, "loss": MARKUP, "grad_norm": MARKUP, "update_skipped": True, "in_a_row": 1, "limit": 3},
    "rollback": {"step": 3, "steps": [3], "rollback": 1, "max_rollbacks": 2, "cause": MARKUP, "skip_batches": [3]},
    "eval": {"step": 3, "eval_loss": 1.0, "eval_ppl": 2.7, "batches": 2, "seconds": 0.5},
    "batch_skipped": {"step": 3},
    "loss_spike": {"step": 3, "loss": 9.0, "zscore": 6.0, "window_mean": 2.0},
    "out_of_memory": {"step": 3, "rank": 0, "micro_batch": 4, "report_path": MARKUP, "retry_micro_batch": 2},
    "leak": {"step": 3, "tensors": 10, "kind": MARKUP, "per_step": 1, "bytes_per_step": 100},
    "hang": {"step": 3, "behind": 1, "doing": MARKUP, "report_path": MARKUP},
    "overflow": {"step": 3, "loss": 4.0, "loss_scale": 65536.0, "next_scale": 32768.0},
}


def test_every_event_prints_outside_text_as_text_even_on_a_console_that_reads_markup():
    with_lines = {kind.model_fields["event"].default for kind in EVENT_TYPES if kind.line is not Event.line}
    assert set(EVENTS) == with_lines, "a new event kind needs a row here"
    out = io.StringIO()
    view = ProgressView(10, 0, console=Console(file=out, force_terminal=False, width=400))  # markup on, as a notebook's own
    for kind, fields in EVENTS.items():
        view.print(parse_event({"event": kind, **fields}).line())
    view.layout([{"rank": 0, "pp": 0, "dp": 0, "tp": 0, "node": MARKUP, "ip": MARKUP}])
    text = out.getvalue()
    assert text.count(MARKUP) >= sum(str(e).count(MARKUP) for e in EVENTS.values() if "changes" not in e)


def test_the_live_bar_and_lmforge_consoles_print_markup_as_text():
    from lmforge.console import text_console

    console = text_console()
    console.file = io.StringIO()
    console.print(f"preparing {MARKUP} into :smile:")
    assert console.file.getvalue().strip() == f"preparing {MARKUP} into :smile:"
    live = Console(file=io.StringIO(), force_terminal=True, width=200)
    with ProgressView(10, 0, console=live) as view:
        view.print(f"failure: {MARKUP}")
        view.step(step(1))
    assert MARKUP in live.file.getvalue()

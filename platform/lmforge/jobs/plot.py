"""One figure of a run: loss and held-out loss by step, tokens/s on a second axis,
and the events that explain a curve's shape (failures, recoveries, resizes, rollbacks)."""

from __future__ import annotations

MARKED = {"failure": "tab:red", "recovered": "tab:green", "resized": "tab:purple", "rollback": "tab:orange"}


def plot_metrics(frame, title: str = ""):
    from matplotlib.figure import Figure  # not pyplot: no global figure, no GUI backend

    figure = Figure(figsize=(9, 4.5))
    loss_axis = figure.subplots()
    steps = frame[frame["event"] == "step"] if len(frame) else frame
    if len(steps):
        loss_axis.plot(steps["step"], steps["loss"], label="loss", color="tab:blue")
    evals = frame[frame["event"] == "eval"] if len(frame) else frame
    if len(evals):
        loss_axis.plot(evals["step"], evals["eval_loss"], "o-", label="held-out loss", color="tab:cyan")
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("loss")
    if len(steps) and "tokens_per_s" in steps:
        rate_axis = loss_axis.twinx()
        rate_axis.plot(steps["step"], steps["tokens_per_s"], label="tokens/s", color="tab:gray", alpha=0.5)
        rate_axis.set_ylabel("tokens/s")
    for kind, color in MARKED.items():
        for n, step in enumerate(frame.loc[frame["event"] == kind, "step"] if len(frame) else []):
            loss_axis.axvline(step, color=color, linestyle="--", label=kind if n == 0 else None)
    loss_axis.legend(loc="upper right")
    loss_axis.set_title(title)
    figure.tight_layout()
    _render_inline()
    return figure


def _render_inline() -> None:
    """In a notebook kernel, have a returned Figure render as a PNG. pyplot's inline
    backend registers that formatter only once pyplot is imported, which we avoid."""
    try:
        from IPython import get_ipython
        from matplotlib_inline.backend_inline import set_matplotlib_formats
    except ImportError:  # not in IPython: nothing renders figures anyway
        return
    if get_ipython() is not None:
        set_matplotlib_formats("png")

"""A PNG stacked-bar chart of memory breakdowns (a job's pipeline stages, or the
layouts a search found), with the device's limit drawn across."""

from __future__ import annotations

import textwrap
from pathlib import Path

from lmforge.memory.estimate import Breakdown

PARTS = (
    ("params", "parameters"),
    ("grads", "gradients"),
    ("optimizer", "optimizer states"),
    ("teacher", "teacher weights"),
    ("activations", "activations"),
    ("temporary", "temporary buffers"),
)


def bar_chart(path: str | Path, title: str, bars: list[tuple[str, Breakdown]], limits: dict[str, int] | None = None) -> Path:
    """Write one stacked bar (GiB) per (label, breakdown); `limits`: horizontal lines
    by label, such as the device memory and what a job may use of it."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    from matplotlib import pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(bars) + 2), 4.8))
    try:
        bottoms = [0.0] * len(bars)
        positions = range(len(bars))
        for key, label in PARTS:
            heights = [getattr(b, key) / 2**30 for _, b in bars]
            ax.bar(positions, heights, bottom=bottoms, label=label)
            bottoms = [base + h for base, h in zip(bottoms, heights)]
        for (name, value), style in zip((limits or {}).items(), ("-", "--", ":")):
            ax.axhline(value / 2**30, color="black", linestyle=style, linewidth=1, label=name)
        ax.set_xticks(list(positions), [textwrap.fill(label, 14) for label, _ in bars], fontsize=8)
        ax.set_ylabel("GiB per device")
        ax.set_title(textwrap.fill(title, 60), fontsize=10)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path

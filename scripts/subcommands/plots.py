"""The style every benchmark plot shares (``cpu.py report``, ``gpu.py bench``): the modes' labels, matplotlib on
the Agg backend, one gridded axes per figure."""

from __future__ import annotations

from pathlib import Path

from streambp_trl.bench.spec import Mode

LABELS = {
    Mode.PLAIN: "no checkpointing",
    Mode.CHECKPOINT: "HF checkpointing",
    Mode.CHECKPOINT_CHUNKED_LOSS: "TRL default (ckpt + fused head)",
    Mode.STREAM: "stream",
    Mode.STREAM_OFFLOAD: "stream + offload",
}


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display); ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def new_axes(title: str, ylabel: str, xlabel: str = "sequence length (tokens)"):
    """A figure with one gridded axes in the style of every benchmark plot."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def save_figure(fig, path: Path) -> Path:
    """Writes ``fig`` to ``path`` and closes it."""
    fig.tight_layout()
    fig.savefig(path)
    pyplot().close(fig)
    return path

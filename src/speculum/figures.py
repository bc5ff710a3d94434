"""Figures written to files (the reports' plots): matplotlib on its file-only backend."""

from __future__ import annotations


def subplots(*args, **kwargs):
    """``matplotlib.pyplot.subplots(*args, **kwargs)`` on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def save(fig, path, dpi: int = 120) -> None:
    """Lay ``fig`` out, write it to ``path`` and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)

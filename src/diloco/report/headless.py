"""matplotlib for figures written to files: its Agg backend, no display needed."""

from __future__ import annotations


def headless_pyplot():
    """``matplotlib.pyplot`` on the Agg backend (imported on first use: matplotlib is only
    needed by what draws)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt

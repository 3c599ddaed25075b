"""The one writer of ``metrics.jsonl``: the global model's held-out measures over a run.

Every mode writes the same record (``diloco.report.run_files`` and the dashboard read it
back): ``t`` (seconds since the run started), ``val_loss``, one ``val_<name>`` per other
held-out measure of the recipe, ``versions`` (committed versions summed over the fragments;
data-parallel: optimizer steps), ``tokens`` (trained so far; None when unknown) and
``rounds`` (committed rounds; data-parallel: steps; None when unknown).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
"""Its name in a run directory."""


def append_metric(
    run_dir: Path,
    *,
    started: float,
    val_loss: float,
    scores: dict[str, float] | None,
    versions: int,
    tokens: int | None,
    rounds: int | None,
    now: float | None = None,
) -> dict:
    """Append one record to ``run_dir/metrics.jsonl`` and return it. ``started`` and ``now``
    are epoch seconds (``now``: the wall clock when not given)."""
    record = {
        "t": round((time.time() if now is None else now) - started, 3),
        "val_loss": val_loss,
        **{f"val_{name}": value for name, value in (scores or {}).items()},
        "versions": versions,
        "tokens": tokens,
        "rounds": rounds,
    }
    with (Path(run_dir) / METRICS_FILE).open("a") as f:
        f.write(json.dumps(record) + "\n")
    return record

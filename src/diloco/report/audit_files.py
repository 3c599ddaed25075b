"""The exactly-once audit (``diloco.report.exactly_once``) of a run read from its files: a
syncer's state directory and its learners' work directories, wherever they ran (``diloco
run``, Slurm jobs, Ray actors, hand-started processes)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from diloco.learner.journal import JOURNAL_FILE
from diloco.report.exactly_once import Audit, audit
from diloco.runtime.jsonl import read_jsonl

FINAL_ACCOUNTING = "final.json"
"""A learner's accounting at a clean stop, in its work directory (written by the learner
worker, ``diloco.launch.learner_worker``, which imports this name)."""


def disk_versions(state_dir: Path) -> dict[int, int]:
    """The committed version of every fragment in a syncer's state directory."""
    from diloco.algorithm.fragments import FragmentLayout
    from diloco.syncer.store import FragmentStore

    layout = FragmentLayout.from_dict(json.loads((state_dir / "meta.json").read_text())["layout"])
    store = FragmentStore(state_dir)
    versions = {}
    for p in range(layout.num_fragments):
        loaded = store.load(p, layout.fragments[p].numel)
        if loaded is not None:
            versions[p] = loaded[0]
    return versions


def audit_directories(state_dir: Path, workdirs: Mapping[str, Path], **options) -> Audit:
    """Audit the run whose syncer kept ``state_dir`` and whose learners (id -> work
    directory) kept ``workdirs``: the tape, every learner's journal and final accounting
    (missing: it did not stop cleanly) and the versions on disk. ``options`` go to
    :func:`~diloco.report.exactly_once.audit` (``stopped_cleanly``, the stall check)."""
    state_dir = Path(state_dir)
    finals = {}
    for learner, workdir in workdirs.items():
        path = Path(workdir) / FINAL_ACCOUNTING
        finals[learner] = json.loads(path.read_text()) if path.exists() else None
    return audit(
        read_jsonl(state_dir / "events.jsonl"),
        {learner: read_jsonl(Path(w) / JOURNAL_FILE) for learner, w in workdirs.items()},
        finals,
        disk_versions=disk_versions(state_dir),
        **options,
    )

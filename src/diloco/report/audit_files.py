"""The exactly-once audit (``diloco.report.exactly_once``) of a run read from its files: a
syncer's state directory and its learners' work directories, wherever they ran (``diloco
run``, Slurm jobs, Ray actors, hand-started processes)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from diloco.learner.journal import JOURNAL_FILE
from diloco.learner.workdir import FINAL_ACCOUNTING
from diloco.report.exactly_once import Audit, audit
from diloco.runtime.jsonl import read_jsonl

__all__ = ["FINAL_ACCOUNTING", "audit_directories", "disk_versions"]


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


def audit_directories(
    state_dir: Path,
    workdirs: Mapping[str, Path | Sequence[Path]],
    *,
    tape: Path | None = None,
    **options,
) -> Audit:
    """Audit the run whose syncer kept ``state_dir`` and whose learners (id -> work
    directory, or the work directories of the machines it ran on, the last one current:
    a superseded process and its replacement) kept ``workdirs``: the tape (``tape``, default
    ``STATE_DIR/events.jsonl``), every learner's journals and its final accounting (from its
    current directory; missing: it did not stop cleanly) and the versions on disk.
    ``options`` go to :func:`~diloco.report.exactly_once.audit` (``stopped_cleanly``, the
    stall check)."""
    state_dir = Path(state_dir)
    dirs = {
        k: [Path(v)] if isinstance(v, (str, Path)) else [Path(w) for w in v]
        for k, v in workdirs.items()
    }
    finals = {}
    for learner, paths in dirs.items():
        path = paths[-1] / FINAL_ACCOUNTING
        finals[learner] = json.loads(path.read_text()) if path.exists() else None
    journals = {
        learner: [line for w in paths for line in read_jsonl(w / JOURNAL_FILE)]
        for learner, paths in dirs.items()
    }
    return audit(
        read_jsonl(Path(tape) if tape is not None else state_dir / "events.jsonl"),
        journals,
        finals,
        disk_versions=disk_versions(state_dir),
        **options,
    )

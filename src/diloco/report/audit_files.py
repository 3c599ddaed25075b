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

__all__ = ["FINAL_ACCOUNTING", "audit_directories", "disk_versions", "unstepped_tape"]


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


TAPE_FILE = "events.jsonl"
"""A syncer's event tape in its state directory, where ``--tape`` does not put it elsewhere."""


def audit_directories(
    state_dir: Path | Sequence[Path],
    workdirs: Mapping[str, Path | Sequence[Path]],
    *,
    tape: Path | Sequence[Path] | None = None,
    **options,
) -> Audit:
    """Audit the run whose syncer kept ``state_dir`` (or whose syncer shards kept the state
    directories ``state_dir``, one per shard: their fragments are disjoint, so the union of
    their versions on disk is the syncer's) and whose learners (id -> work directory, or the
    work directories of the machines it ran on, the last one current: a superseded process
    and its replacement) kept ``workdirs``: the tape (``tape``: one file, the shards' shared
    tape, or several, one per shard; default each state directory's ``events.jsonl``), every
    learner's journals and its final accounting (from its current directory; missing: it did
    not stop cleanly) and the versions on disk. ``options`` go to
    :func:`~diloco.report.exactly_once.audit` (``stopped_cleanly``, the stall check)."""
    state_dirs = [Path(state_dir)] if isinstance(state_dir, (str, Path)) else list(state_dir)
    if tape is None:
        tapes = [d / TAPE_FILE for d in state_dirs]
    else:
        tapes = [Path(tape)] if isinstance(tape, (str, Path)) else [Path(t) for t in tape]
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
    versions: dict[int, int] = {}
    for d in state_dirs:  # (a shard's directory holds only the fragments it owns)
        versions.update(disk_versions(Path(d)))
    return audit(
        [record for t in tapes for record in read_jsonl(t)],  # (shards: disjoint fragments)
        journals,
        finals,
        disk_versions=versions,
        **options,
    )


def unstepped_tape(tape: Path, from_byte: int, step_s: float, out: Path) -> Path:
    """A copy of ``tape`` at ``out`` whose records from byte ``from_byte`` on (appended after
    the writers' wall clock stepped by ``step_s`` seconds) have the step taken out of their
    ``t``, for a stall check against the run's own clock: the tape is append-only, so its
    size when the clock stepped divides the records stamped before from those stamped after.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> _ = (d / "t").write_text('{"t": 10.0}\\n{"t": 1.0, "x": 1}\\n')
    >>> read_jsonl(unstepped_tape(d / "t", 12, -40.0, d / "u"))
    [{'t': 10.0}, {'t': 41.0, 'x': 1}]
    """
    data = tape.read_bytes()
    lines = []
    for line in data[from_byte:].decode(errors="replace").splitlines(keepends=True):
        try:
            record = json.loads(line)
        except ValueError:
            record = None  # (a torn line stays as it is)
        if isinstance(record, dict) and isinstance(record.get("t"), (int, float)):
            record["t"] -= step_s
            line = json.dumps(record, separators=(",", ":")) + "\n"
        lines.append(line)
    out.write_bytes(data[:from_byte] + "".join(lines).encode())
    return out

"""When a fragment's next full snapshot is due: pure decisions, torch-free (``diloco plan``
sizes the syncer's disk with them too).

Between two snapshots of a fragment every commit appends one journal record: the uploads it
merged, as they arrived (``diloco.syncer.journal``). A snapshot writes the fragment whole,
``SNAPSHOT_BYTES_PER_VALUE`` bytes per value; a record writes about the compressed bytes its
commit merged. So what a commit makes durable, per value of its fragment, is its record
plus a share of the next snapshot.

- **A fixed interval** (``commits_per_snapshot = K > 0``): a snapshot every K records, so
  12/K bytes per value of each commit go to snapshots whatever the commit merged. With one
  learner's sign1 upload (0.156 B/value) K = 8 makes 0.156 + 1.5 B durable per commit:
  10.6 × what it merged.
- **The automatic interval** (``K = 0``, the default): a snapshot once the records past the
  last one hold ``JOURNAL_SHARE`` of a snapshot's bytes, but never before ``MIN_RECORDS``
  records (the fixed default this replaced: large records, as many learners bring, do not
  make every commit a snapshot) and always by ``MAX_RECORDS`` (what a restart replays). A
  commit then makes durable its record plus at most 1/``JOURNAL_SHARE`` records' worth of
  snapshot (less where ``MIN_RECORDS`` binds): at most about 3.5 × the compressed bytes it
  merged, whatever the number of learners and the up codec, until ``MAX_RECORDS`` binds.
  With today's default exchange at 1B parameters (P = 24, sign1 up) that is a snapshot
  every 8 records with four learners, every 31 with one.

A restart replays the records past each fragment's snapshot, at most the interval less one:
about ``interval / 2`` per fragment, the fragments' cycles being staggered.
"""

from __future__ import annotations

import math

SNAPSHOT_BYTES_PER_VALUE = 12
"""A snapshot's bytes per value of its fragment: Θ_p, momentum and wire image in fp32 (its
header and commit logs aside)."""
JOURNAL_SHARE = 0.4
"""The automatic interval: a fragment's snapshot is due once the journal records past its
last one hold this share of a snapshot's bytes (1 + 1/0.4 = 3.5 × a record per commit)."""
MIN_RECORDS = 8
"""The automatic interval's least number of records between two snapshots of a fragment."""
MAX_RECORDS = 64
"""The automatic interval's bound on the records between two snapshots of a fragment: what
a restart replays at most, however small the uploads."""


def snapshot_bytes(numel: int) -> int:
    """A snapshot's bytes for a fragment of ``numel`` values (its header aside)."""
    return SNAPSHOT_BYTES_PER_VALUE * numel


def snapshot_due(records: int | None, journal_bytes: int, full_bytes: int, every: int) -> bool:
    """Whether a fragment with ``records`` journal records past its snapshot (None: it has
    none yet), together ``journal_bytes`` long, needs a new snapshot of ``full_bytes``
    (``snapshot_bytes``); ``every``: K, 0 for the automatic interval.

    >>> snapshot_due(None, 0, 1200, 8), snapshot_due(7, 0, 1200, 8), snapshot_due(8, 0, 1200, 8)
    (True, False, True)
    >>> snapshot_due(9, 479, 1200, 0), snapshot_due(9, 480, 1200, 0), snapshot_due(64, 64, 1200, 0)
    (False, True, True)
    >>> snapshot_due(7, 9999, 1200, 0)  # (at least MIN_RECORDS records apart)
    False
    """
    if records is None:
        return True
    if every > 0:
        return records >= every
    by_bytes = records >= MIN_RECORDS and journal_bytes >= JOURNAL_SHARE * full_bytes
    return by_bytes or records >= MAX_RECORDS


def records_per_snapshot(record_bytes: float, full_bytes: float, every: int) -> int:
    """The interval, in records, at which snapshots of ``full_bytes`` come when each record
    writes ``record_bytes`` (``every``: K, 0 for the automatic interval).

    >>> records_per_snapshot(26e6, 504e6, 0), records_per_snapshot(6.6e6, 504e6, 0)
    (8, 31)
    >>> records_per_snapshot(1.0, 504e6, 0), records_per_snapshot(26e6, 504e6, 5)
    (64, 5)
    >>> records_per_snapshot(1e9, 504e6, 0)
    8
    """
    if every > 0:
        return every
    if record_bytes <= 0:
        return MAX_RECORDS
    by_bytes = math.ceil(JOURNAL_SHARE * full_bytes / record_bytes)
    return max(MIN_RECORDS, min(MAX_RECORDS, by_bytes))


def first_cycle_head_start(rank: int, fragments: int, interval: int) -> int:
    """The records by which the ``rank``-th of a syncer's ``fragments`` fragments starts its
    first cycle ahead (``rank / fragments`` of its ``interval``, ``records_per_snapshot`` of
    its first record), so that the fragments' snapshots (due together, as the fragments
    commit round-robin) fall in different cycles of the clock, about ``fragments /
    interval`` per cycle: no burst of every fragment's copies waiting for the writer, and a
    restart replays about half an interval per fragment instead of a whole one.

    >>> [first_cycle_head_start(r, 4, 8) for r in range(4)]
    [0, 2, 4, 6]
    >>> [first_cycle_head_start(r, 24, 31) for r in (1, 12, 23)]
    [1, 15, 29]
    """
    return rank * interval // max(1, fragments)

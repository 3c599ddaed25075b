"""A learner's shared per-fragment state, one object its parts are given (``Progress``), and
``HeldBy``: a ``Learner`` attribute that is one of its parts' own.

The ``Learner`` owns a ``Progress`` and hands it to its parts (``settling.Settler``,
``restoring.Restorer``, ``stopping.Stopper``, ``callbacks.LearnerListener``); each part reads
and changes it only on the thread its contract names (the training thread, but for the
listener's reads of ``versions``, ``local_step``, ``total_tokens`` and ``state``).
"""

from __future__ import annotations

import torch

from diloco.learner.journal import UploadJournal

COUNTERS = ("withdrawn", "returned", "merged", "excluded", "unknown", "resyncs", "deferred")
"""Ledger events a learner counts (``Progress.counters``)."""


class Progress:
    """What a learner trained and holds, per fragment, and where its steps went: the state
    its checkpoint carries (``restoring``) and its parts settle (``settling``)."""

    def __init__(self, num_fragments: int) -> None:
        P = num_fragments
        self.local_step = 0
        self.total_tokens = 0
        self.anchors: list[torch.Tensor | None] = [None] * P
        """G_p: the global value of each fragment this learner holds (the syncer's wire
        image at ``versions[p]``, bit for bit); ``None`` before the first arrival."""
        self.versions = [-1] * P
        self.steps_since = [0] * P
        """Steps of the undelivered progress of each fragment (not yet in any delta)."""
        self.tokens_since = [0] * P
        self.dropped = [0] * P
        """Per fragment, trained steps thrown away on purpose (a norm-guard reset, the
        paper's overwrite rule): every trained step is merged, in flight, unsent, excluded
        or counted here (``accounting``)."""
        self.merged_steps = [0] * P
        """Per fragment, trained steps in deltas merged back (``accounting``)."""
        self.excluded_steps = [0] * P
        """Per fragment, trained steps in deltas the syncer left out of their merges."""
        self.unknown_steps = [0] * P
        """Per fragment, trained steps in accepted deltas whose fate no syncer can tell."""
        self.residual: set[int] = set()
        """Fragments whose undelivered progress holds the quantization residual of an accepted
        delta (decoded other than queued), though maybe no step: a new value is rebased onto
        it, never written over (``Learner._apply``), until it goes out or is dropped."""
        self.rebasing: set[int] = set()
        """Fragments waiting for the first keyframe of another lineage (not sent till then)."""
        self.awaited: dict[int, tuple[int, int]] = {}
        """Fragments sent and not yet merged back: p -> (local step sent at, base version)."""
        self.reset_now: set[int] = set()
        """Fragments whose θ changed other than by an arrival since the last apply (a
        norm-guard reset, a delta of unknown fate taken in): an island shares them."""
        self.syncer_ids: dict[str, str] = {}
        """The syncer instance (per address) this learner's ledger was admitted by."""
        self.lineages: dict[str, str] = {}
        """Per syncer (shard) address, the lineage of the versions held (``settling``)."""
        self.counters = dict.fromkeys(COUNTERS, 0)
        """Ledger events: deltas withdrawn before sending (sent again, bigger), returned to
        the undelivered progress (refused, failed, lost with a restarted syncer), merged
        back, left out of their merge by the syncer; fragments resynced because an arrival
        did not fit what this learner holds; requests deferred while the link was behind
        (``diloco.learner.pacing``)."""
        self.journal: UploadJournal | None = None
        """The upload journal (``LearnerConfig.journal_file``), opened once restored."""
        self.state = "starting"
        self.unsettled_from: list[int] = []
        """Per fragment, the oldest admission this learner may still ask about, as of the last
        settle (``settling.unsettled_from``; empty: not known yet): every join and heartbeat
        reports it, so the syncer keeps the commit logs that tell its fates."""
        """What the learner is doing, for its heartbeat: starting, training, closed."""

    def journal_settled(self, upload_id: int, how: str, version: int | None = None) -> None:
        """Journal how upload ``upload_id`` was settled (nothing without a journal or id)."""
        if self.journal is not None and upload_id:
            self.journal.settled(upload_id, how, version)


class HeldBy:
    """A class attribute naming where an instance attribute lives: ``x = HeldBy("part")``
    reads and writes ``obj.part.x`` (or ``obj.part.<name>``), so a ``Learner``'s public
    attribute stays where callers look for it while one of its parts owns it."""

    def __init__(self, part: str, name: str | None = None) -> None:
        self.part, self.name = part, name

    def __set_name__(self, owner, name: str) -> None:
        self.name = self.name or name

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(getattr(obj, self.part), self.name)

    def __set__(self, obj, value) -> None:
        setattr(getattr(obj, self.part), self.name, value)

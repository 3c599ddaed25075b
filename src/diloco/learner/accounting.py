"""A learner's accounting: where every step it trained went, per fragment.

Every inner step trains every fragment, so per fragment p the ``trained`` steps are the
learner's step count, and each of them is in exactly one of

* ``merged``: in a delta a committed round merged (the version holding it was applied);
* ``in_flight``: in a delta the syncer accepted whose merge has not come back yet;
* ``unsent``: not yet in a delta the syncer accepted (the undelivered progress, and deltas
  queued or sent without an answer): after ``close``, the *unsent tail*;
* ``dropped``: thrown away on purpose by the learner (a norm-guard reset, the paper's
  overwrite rule, the steps trained before the fragment first arrived);
* ``excluded``: in a delta the syncer accepted and then left out of its round's merge (its
  direction check): never merged;
* ``unknown``: in a delta that may or may not have been merged, and that no syncer can tell
  any more (it was admitted before the oldest commit log the syncer keeps, and its answer
  or its merge never reached the learner: a partition longer than the syncer's
  ``RETAINED_COMMIT_LOGS``): neither counted merged nor sent again. 0 wherever the fate was
  knowable.

``Learner.accounting()`` returns it; ``balanced`` checks the identity. A checker that reads
the syncer's event tape finds the same ``merged`` steps in its ``round`` records (the
``uploads`` of each participant), which is how ``tests/test_torture.py`` proves that every
step is merged exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Accounting:
    trained: int
    """Steps trained (the same for every fragment)."""
    merged: tuple[int, ...]
    in_flight: tuple[int, ...]
    unsent: tuple[int, ...]
    dropped: tuple[int, ...]
    excluded: tuple[int, ...]
    unknown: tuple[int, ...] = ()
    """Per fragment (empty: 0 everywhere)."""

    def balanced(self) -> bool:
        """Every trained step of every fragment is in exactly one of the six columns."""
        unknown = self.unknown or (0,) * len(self.merged)
        columns = zip(
            self.merged,
            self.in_flight,
            self.unsent,
            self.dropped,
            self.excluded,
            unknown,
            strict=True,
        )
        return all(sum(c) == self.trained for c in columns)

    def to_dict(self) -> dict:
        return {
            "trained": self.trained,
            "merged": list(self.merged),
            "in_flight": list(self.in_flight),
            "unsent": list(self.unsent),
            "dropped": list(self.dropped),
            "excluded": list(self.excluded),
            "unknown": list(self.unknown or (0,) * len(self.merged)),
        }

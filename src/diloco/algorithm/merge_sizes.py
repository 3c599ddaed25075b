"""How much of an upload the syncer's merge decodes at once: arithmetic only, without torch,
so that the planner (``diloco.plan.syncer``) sizes a syncer's memory without loading it. The
merge itself is ``diloco.algorithm.streaming``'s."""

from __future__ import annotations

WHOLE_SPAN_VALUES = 1 << 23
"""An encoded delta's span of one tensor up to this many values (32 MB of float32) is
decoded whole, once, into a ``scratch`` buffer that serves both its norm and the sums (a
merge of M contributions then holds M of them); a larger one is read twice, whole for its
norm and a chunk at a time for the sums (``streaming.merge_into``)."""

"""What the syncer and its learners must agree on: the protocol's settings and constants.

``ProtocolConfig`` (P, the fragments the model is cut into, and H, the sync period) is owned
here once and composed by every configuration that needs it (the syncer's, the learner
process's, the launcher's). A learner checks P at join (the layout hash) and takes H from the
syncer's join reply: the syncer's clock owns it. The wire constants are those both ends size
their messages and deadlines with.
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco.runtime.renamed import p_is_num_fragments, renamed_keywords
from diloco.runtime.schema import option
from diloco.wire.comms import COMMS, comms_setting

CHUNK_BYTES = 1 << 20
"""Tensor bytes per gRPC message: ~1 MB is fastest on loopback."""
MAX_MESSAGE_BYTES = 4 * CHUNK_BYTES
"""gRPC message limit on both ends (a chunk plus headers fits with room to spare)."""
FIRST_CHUNK_S = 20.0
"""The syncer cancels an upload whose first chunk has not arrived after this many seconds."""
MIN_UPLOAD_BPS = 16_000.0
"""An upload may take ``FIRST_CHUNK_S`` plus its size at this rate (bytes/s, 128 kbit/s)."""


def syncer_upload_deadline_s(nbytes: int, first_chunk_s: float = FIRST_CHUNK_S) -> float:
    """The longest the syncer lets an upload of ``nbytes`` take (it cancels it then): its
    first chunk's wait (``first_chunk_s``) plus its size at ``MIN_UPLOAD_BPS``. The learner
    never waits longer for one either."""
    return first_chunk_s + nbytes / MIN_UPLOAD_BPS


@renamed_keywords(fragments=p_is_num_fragments)
@dataclass(kw_only=True, frozen=True)
class ProtocolConfig:
    """How the model is cut and how often each piece is synchronised."""

    num_fragments: int = option(24, flag="--fragments", metavar="P")
    """P: fragments the model is cut into (the syncer and every learner must agree)."""
    comms: str | None = option(None, choices=tuple(COMMS), metavar="|".join(COMMS))
    """The named communication setting (``diloco.wire.comms``): H and the syncer's codecs,
    each overridden by its own flag. default: H=16, sign1 up, int2 down; low: H=24, sign1
    both ways without down feedback; lowest: H=128, sign1w (wide blocks) both ways without
    down feedback. Given to a learner by hand, the most its link accepts: it refuses a
    syncer whose exchange is heavier."""
    sync_every: int = option(None, type=int, metavar="H")  # type: ignore[assignment]
    """H: inner steps between two synchronisations of one fragment (the syncer's clock opens
    each fragment's round once per H fleet steps); default: the ``--comms`` setting's (16)."""

    def __post_init__(self) -> None:
        if self.sync_every is None:  # resolved once, here: the configuration holds the value
            object.__setattr__(self, "sync_every", comms_setting(self.comms).sync_every)
        else:
            comms_setting(self.comms)  # a bad name is refused either way
        if self.num_fragments < 1 or self.sync_every < 1:
            raise ValueError(
                f"--fragments and --sync-every must be >= 1 "
                f"(got {self.num_fragments}, {self.sync_every})"
            )


SUPERSEDED_KEY = "diloco-superseded"
"""Trailing metadata of a join refused because a newer process of its learner id joined
(``JoinRequest.generation``): its value is that newer generation. Fatal to the refused
process: it must stop, never join again."""
NOT_ADMITTED_KEY = "diloco-not-admitted"
"""Trailing metadata of a refused upload whose id the syncer can tell was never admitted:
its receipts do not hold it, its base version is within the commit logs it keeps, and no
other copy of it is on its way in. Without it, a refused resend's fate is unknown (an
earlier copy may have been accepted): the learner neither counts it merged nor sends it
again."""

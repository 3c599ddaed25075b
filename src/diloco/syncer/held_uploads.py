"""What a join reply tells a learner of its uploads the syncer holds: every id
(``JoinReply.committed_uploads``, what a learner that predates ``fates`` reads) and, told
apart, those a committed round left out and those in rounds still open
(``JoinReply.fates``; the rest were merged). A learner restored from a checkpoint settles
its previous life's uploads by it (``docs/algorithm.md``, "Restart from a checkpoint"): none
is counted merged on sight, and nothing depends on the heartbeat's note of the most recent
left-out uploads."""

from __future__ import annotations

from diloco.syncer.receipts import Receipts
from diloco.wire import diloco_pb2 as pb


def held_uploads(receipts: Receipts, learner: str) -> dict:
    """The ``JoinReply`` fields on ``learner``'s held uploads (``committed_uploads`` and
    ``fates``), from the syncer's ``receipts`` (the syncer's lock held)."""
    fates = receipts.fates(learner)
    return {
        "committed_uploads": list(fates),
        "fates": pb.UploadFates(
            excluded=[u for u, fate in fates.items() if fate.excluded],
            open=[
                pb.OpenUpload(upload_id=u, admitted=fate.admitted)
                for u, fate in fates.items()
                if not fate.committed
            ],
        ),
    }

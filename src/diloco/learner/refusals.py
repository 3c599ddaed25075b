"""What a learner's link makes of the syncer's refusals (pure: a status code and trailing
metadata in, a decision out).

**A refused upload.** A first send refused is not accepted: its progress goes back to the
learner and out again (``refused``; ``guard`` for the norm guard's refusal, which resets the
fragment). A *resend* (the upload id went out before without an answer) is different: the
earlier copy may have been accepted, its reply lost, and the refusal of this copy says
nothing about that one. So a refused resend's outcome is ``unknown`` (neither merged nor sent
again; its steps counted unknown, ``diloco.learner.settling``), never "not accepted",
unless the syncer proves otherwise: it marks the refusal ``NOT_ADMITTED_KEY`` when its
receipts do not hold the id, the upload's base version is within the commit logs it keeps
(so a commit that merged an earlier copy would be listed), and no other copy is arriving.
Then no syncer instance whose commits it holds merged the upload, nor will (an accepted
copy whose round died with a restarted syncer was never merged): the progress goes out
again. A syncer that answers a resend from its receipts before anything else never refuses
one it holds; one that predates the mark never gives it, and its refusals of resends are
unknown.

**A refused join.** Refusals that retrying cannot fix end the link (fatal: the learner
raises them to the user): any refusal of the first join (another model, a bad token), and
at any time a join refused because a newer process of this learner id joined
(``SUPERSEDED_KEY``, ``diloco.syncer.generations``): this process is a zombie, it must
stop training.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc

from diloco.wire.protocol import NOT_ADMITTED_KEY, SUPERSEDED_KEY

REFUSALS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.UNAUTHENTICATED,
    }
)
"""Status codes by which the syncer refuses a request; any other (unavailable, deadline,
exhausted stream caps) means no answer."""
JOIN_REFUSALS = frozenset(
    {
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
    }
)
"""Status codes of a refused join that end the link when it never joined before."""


def _value(metadata: Iterable | None, key: str) -> str | None:
    for item in metadata or ():
        if item[0] == key:
            return item[1]
    return None


def upload_refusal(code, metadata: Iterable | None, *, resend: bool) -> str | None:
    """The outcome of an upload that failed with status ``code`` and trailing ``metadata``:
    ``refused`` or ``guard`` (not accepted), ``unknown`` (a resend not proven never
    admitted: see the module docstring), or None (not a refusal: no answer)."""
    if code not in REFUSALS:
        return None
    if resend and _value(metadata, NOT_ADMITTED_KEY) is None:
        return "unknown"
    return "guard" if code == grpc.StatusCode.OUT_OF_RANGE else "refused"


def fatal_join_refusal(code, metadata: Iterable | None, *, joined_before: bool) -> bool:
    """Whether a join that failed with ``code`` and trailing ``metadata`` ends the link: a
    superseded process always, another refusal only of a link that never joined."""
    if code == grpc.StatusCode.FAILED_PRECONDITION and _value(metadata, SUPERSEDED_KEY):
        return True
    return code in JOIN_REFUSALS and not joined_before

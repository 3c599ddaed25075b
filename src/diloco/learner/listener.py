"""What a ``SyncerLink`` asks of its owner and tells it: one object, not a bag of callbacks.

Every method runs on one of the link's threads (``link``, ``sender``, ``heartbeat``), never on
the training thread: an implementation hands what it gets to its owner under a lock, and
answers the link's questions (what it holds, what to heartbeat) without blocking. The
defaults are an owner that holds nothing and ignores everything; an observer overrides
``on_fragment`` and ``have_versions``, a learner overrides all of them
(``diloco.learner.callbacks``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diloco.learner.uploads import UploadJob, UploadResult


@dataclass(frozen=True)
class HeldFates:
    """What a join reply tells of the held upload ids it lists (``JoinReply.fates``): those a
    committed round left out (``excluded``) and those in rounds still open, with the version
    each was admitted at (``open``: id -> version); the rest were merged."""

    excluded: frozenset[int] = frozenset()
    open: dict[int, int] = field(default_factory=dict)

    @classmethod
    def of_reply(cls, reply) -> HeldFates | None:
        """From a ``JoinReply``; None from a syncer that predates ``fates``, whose list does
        not tell an upload in an open round from a committed one."""
        if not reply.HasField("fates"):
            return None
        told = reply.fates
        return cls(frozenset(told.excluded), {o.upload_id: o.admitted for o in told.open})


class LinkListener:
    """The owner's side of a link (see the module docstring)."""

    def have_versions(self) -> list[int]:
        """Per fragment, the version held (-1: none, a keyframe is needed); sent with every
        subscription so that the syncer sends deltas on top of it."""
        return []

    def have_digests(self) -> list[str]:
        """Per fragment never received, the digest of the value held ("" for none): the
        syncer then sends no payload when it is its own (``on_fragment`` gets ``None``)."""
        return []

    def heartbeat_info(self) -> dict:
        """``step``, ``tokens``, ``steps_per_s`` and ``state`` for the next heartbeat."""
        return {}

    def unsettled_from(self) -> list[int]:
        """Per fragment, the oldest admission the owner may still ask about, sent with every
        join and heartbeat (``JoinRequest.unsettled_from``; empty: none reported)."""
        return []

    def on_rejoin(
        self,
        address: str,
        syncer_id: str,
        versions: list[int],
        fragments: tuple[int, ...],
        committed: list[str],
        logged_from: list[int],
        lineage: str = "",
        fates: HeldFates | None = None,
    ) -> None:
        """After every join to ``address``: the syncer instance, its versions, the fragments
        it owns, this learner's upload ids it holds (``committed``: its commit logs' and
        its open rounds'; ``fates`` tells them apart, None from a syncer that predates it),
        per fragment, the version its oldest log admitted at (``logged_from``), and the
        lineage of its versions (``diloco.syncer.lineage``; "" from a syncer that predates
        them). Called before the subscription that follows: ``have_versions`` may change here."""

    def on_fragment(
        self,
        fragment: int,
        version: int,
        value: torch.Tensor | None,
        contributors: frozenset[str],
        base_version: int,
    ) -> None:
        """A new global version of ``fragment``: a keyframe (``base_version`` -1, the value),
        a delta on top of ``base_version``, or ``None`` when the value held is the syncer's
        (its digest matched)."""

    def on_request(self, fragment: int, version: int) -> None:
        """The syncer's clock asks for ``fragment`` (its round after ``version``)."""

    def on_result(self, job: UploadJob, result: UploadResult) -> None:
        """The one answer to a submitted upload (never for a withdrawn one)."""

    def on_versions(self, address: str, versions: list[int], dropped: list[str]) -> None:
        """The syncer's current versions (empty when the note came with a download) and the
        ids of this learner's uploads it left out of their merges."""

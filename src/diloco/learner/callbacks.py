"""A learner's ``LinkListener``: what its link tells it (on the link's threads) only goes to
the training thread through the inbox, under its lock; what the link asks (versions held,
digests, heartbeat fields) is read without blocking."""

from __future__ import annotations

import logging

import torch

from diloco.algorithm.fragments import fragment_digest
from diloco.learner.inbox import Dropped, Rejoin
from diloco.learner.link import UploadJob, UploadResult
from diloco.learner.listener import LinkListener
from diloco.learner.pacing import DOWNLINK_BEHIND_VERSIONS, versions_missing
from diloco.learner.settling import another_lineage

log = logging.getLogger("diloco.learner.learner")


class LearnerListener(LinkListener):
    """A ``Learner``'s side of its link (it uses the learner's inbox, link, layout,
    parameters, versions and step counters)."""

    def __init__(self, learner) -> None:
        self.learner = learner
        self.joined_lineages: dict[str, str] = dict(learner.lineages)
        """Per syncer (shard) address, the lineage of its last join (on the link's thread;
        the learner's own ``lineages`` follow when it settles that join)."""

    def on_fragment(
        self,
        fragment: int,
        version: int,
        value: torch.Tensor,
        contributors=frozenset(),
        base_version: int = -1,
    ) -> None:
        if not self.learner._inbox.arrive(fragment, version, base_version, value, contributors):
            self.learner.link.reconnect()  # "you hold it already", but we claimed nothing: resync

    def on_request(self, fragment: int, version: int) -> None:
        self.learner._inbox.request(fragment)

    def on_versions(self, address: str, versions: list[int], dropped=()) -> None:
        """How many versions this learner lacks of the fragment it is furthest behind on,
        against the versions a syncer (shard) just reported (``pacing.versions_missing``);
        the uploads it says it left out of their merges go to the training thread."""
        if dropped:
            self.learner._inbox.dropped(Dropped(address, frozenset(dropped)))
        if not versions:  # (a note that came with a version's download)
            return
        have = self.learner._inbox.have_versions(self.learner.versions)
        missing = [versions_missing(v, have[p]) for p, v in enumerate(versions[: len(have)])]
        self.learner._down_lags[address] = max((m for m in missing if m is not None), default=0)

    def on_result(self, job: UploadJob, result: UploadResult) -> None:
        if result.outcome == "accepted" and self.learner.delivery is not None:
            try:
                self.learner.delivery.record(job.fragment, job.local_step)
            except OSError as exc:  # a full disk must not stop training; a restore may resend
                log.warning("delivery log %s: %s", self.learner.delivery.path, exc)
        self.learner._inbox.answer(job, result)

    def on_rejoin(
        self,
        address: str,
        syncer_id: str,
        versions: list[int],
        fragments,
        committed=(),
        logged_from=(),
        lineage: str = "",
    ) -> None:
        """A syncer of another lineage than the one held (``settling.another_lineage``):
        its fragments take a rebase keyframe (``Inbox.restart``, before the subscription
        that follows asks for what it lacks)."""
        log.info(
            "learner %s joined %s (syncer %s): fragments %s at versions %s",
            self.learner.learner_id,
            address,
            syncer_id,
            list(fragments),
            list(versions),
        )
        held = self.learner._inbox.have_versions(self.learner.versions)
        known = self.joined_lineages.get(address)
        another = another_lineage(known, lineage, held, list(versions), tuple(fragments))
        if lineage:
            self.joined_lineages[address] = lineage
        if another:
            log.warning(
                "learner %s: %s serves another lineage (%s, was %s; versions %s, held %s): "
                "its accepted uploads there count as unknown, it takes keyframes",
                self.learner.learner_id,
                address,
                lineage or "not said",
                known or "not known",
                list(versions),
                held,
            )
            self.learner._inbox.restart(fragments)
        self.learner._inbox.rejoin(
            Rejoin(
                address,
                syncer_id,
                list(versions),
                tuple(fragments),
                frozenset(committed),
                tuple(logged_from),
                lineage,
                another,
            )
        )

    def have_versions(self) -> list[int]:
        """What this learner will hold once it applied what arrived (the syncer sends deltas
        on top of it); -1 for a fragment that needs a keyframe."""
        return self.learner._inbox.have_versions(self.learner.versions)

    def have_digests(self) -> list[str]:
        """Digests of the fragments never received, with a copy of the values they cover: a
        learner built from the same initialization as the syncer's model (the usual start)
        then downloads nothing at join. Called by the link at each subscription."""
        digests = []
        with torch.no_grad():
            for p in range(self.learner.layout.num_fragments):
                if self.learner.versions[p] >= 0 or self.learner._inbox.needs_keyframe(p):
                    digests.append("")
                    continue
                value = self.learner.layout.gather(p, self.learner.params).detach().clone()
                self.learner._inbox.claim(p, value)
                digests.append(fragment_digest(value))
        return digests

    def heartbeat_info(self) -> dict:
        sps = 1.0 / self.learner._step_time if self.learner._step_time else 0.0
        behind = ["link behind"] if self.learner._behind else []
        if self.learner.down_lag >= DOWNLINK_BEHIND_VERSIONS:
            behind.append("downlink behind")
        return {
            "step": self.learner.local_step,
            "tokens": self.learner.total_tokens,
            "steps_per_s": sps,
            "state": ", ".join([self.learner._state, *behind]),
        }

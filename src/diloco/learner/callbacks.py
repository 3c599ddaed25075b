"""What a learner's link calls (from its own threads): they only hand things to the training
thread through the inbox, under its lock, or read what the link must send (a mixin of
``diloco.learner.learner.Learner``)."""

from __future__ import annotations

import logging

import torch

from diloco.algorithm.fragments import fragment_digest
from diloco.learner.inbox import Dropped, Rejoin
from diloco.learner.link import UploadJob, UploadResult
from diloco.learner.pacing import DOWNLINK_BEHIND_VERSIONS, versions_missing

log = logging.getLogger("diloco.learner.learner")


class LinkCallbacks:
    """The link's callbacks of ``Learner`` (it uses the learner's inbox, link, layout,
    parameters, versions and step counters)."""

    def _on_fragment(
        self,
        fragment: int,
        version: int,
        value: torch.Tensor,
        contributors=frozenset(),
        base_version: int = -1,
    ) -> None:
        if not self._inbox.arrive(fragment, version, base_version, value, contributors):
            self.link.reconnect()  # "you hold it already", but we claimed nothing: resync

    def _on_request(self, fragment: int, version: int) -> None:
        self._inbox.request(fragment)

    def _on_versions(self, address: str, versions: list[int], dropped=()) -> None:
        """How many versions this learner lacks of the fragment it is furthest behind on,
        against the versions a syncer (shard) just reported (``pacing.versions_missing``);
        the uploads it says it left out of their merges go to the training thread."""
        if dropped:
            self._inbox.dropped(Dropped(address, frozenset(dropped)))
        if not versions:  # (a note that came with a version's download)
            return
        have = self._inbox.have_versions(self.versions)
        missing = [versions_missing(v, have[p]) for p, v in enumerate(versions[: len(have)])]
        self._down_lags[address] = max((m for m in missing if m is not None), default=0)

    def _on_result(self, job: UploadJob, result: UploadResult) -> None:
        if result.outcome == "accepted" and self.delivery is not None:
            try:
                self.delivery.record(job.fragment, job.local_step)
            except OSError as exc:  # a full disk must not stop training; a restore may resend
                log.warning("delivery log %s: %s", self.delivery.path, exc)
        self._inbox.answer(job, result)

    def _on_rejoin(
        self,
        address: str,
        syncer_id: str,
        versions: list[int],
        fragments,
        committed=(),
        logged_from=(),
    ) -> None:
        self._inbox.rejoin(
            Rejoin(
                address,
                syncer_id,
                list(versions),
                tuple(fragments),
                frozenset(committed),
                tuple(logged_from),
            )
        )

    def _have_versions(self) -> list[int]:
        """What this learner will hold once it applied what arrived (the syncer sends deltas
        on top of it); -1 for a fragment that needs a keyframe."""
        return self._inbox.have_versions(self.versions)

    def _have_digests(self) -> list[str]:
        """Digests of the fragments never received, with a copy of the values they cover: a
        learner built from the same initialization as the syncer's model (the usual start)
        then downloads nothing at join. Called by the link at each subscription."""
        digests = []
        with torch.no_grad():
            for p in range(self.layout.num_fragments):
                if self.versions[p] >= 0 or self._inbox.needs_keyframe(p):
                    digests.append("")
                    continue
                value = self.layout.gather(p, self.params).detach().clone()
                self._inbox.claim(p, value)
                digests.append(fragment_digest(value))
        return digests

    def _heartbeat_info(self) -> dict:
        sps = 1.0 / self._step_time if self._step_time else 0.0
        behind = ["link behind"] if self._behind else []
        if self.down_lag >= DOWNLINK_BEHIND_VERSIONS:
            behind.append("downlink behind")
        return {
            "step": self.local_step,
            "tokens": self.total_tokens,
            "steps_per_s": sps,
            "state": ", ".join([self._state, *behind]),
        }

"""A learner's ``LinkListener``: what its link tells it (on the link's threads) only goes to
the training thread through the inbox, under its lock; what the link asks (versions held,
digests, heartbeat fields) is read without blocking."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from diloco.algorithm.fragments import FragmentLayout, fragment_digest
from diloco.learner.delivery import DeliveryLog
from diloco.learner.inbox import Dropped, Inbox, Rejoin
from diloco.learner.link import UploadJob, UploadResult
from diloco.learner.listener import HeldFates, LinkListener
from diloco.learner.pacing import DOWNLINK_BEHIND_VERSIONS, Pacer, versions_missing
from diloco.learner.progress import Progress
from diloco.learner.settling import another_lineage

log = logging.getLogger("diloco.learner.learner")


class LearnerListener(LinkListener):
    """A ``Learner``'s side of its link. Given: the ``inbox`` it hands everything to, the
    learner's ``progress`` (it reads the versions held, the step and tokens, the state),
    its ``layout`` and ``params`` (digests of values never received), its ``pacer`` (step
    time, whether its uploads fall behind), its ``delivery`` log (or None) and ``reconnect``
    (asks the link to join again). It owns what the syncers last said of this learner's
    downlink (``down_lag``) and the lineages of their last joins."""

    def __init__(
        self,
        learner_id: str,
        inbox: Inbox,
        progress: Progress,
        layout: FragmentLayout,
        params: dict[str, nn.Parameter],
        pacer: Pacer,
        delivery: DeliveryLog | None,
        *,
        reconnect: Callable[[], None],
    ) -> None:
        self.learner_id, self.inbox, self.progress = learner_id, inbox, progress
        self.layout, self.params, self.pacer = layout, params, pacer
        self.delivery, self.reconnect = delivery, reconnect
        self.down_lags: dict[str, int] = {}
        """Per syncer (shard), the versions this learner lacked of its furthest-behind fragment
        at the last heartbeat (``on_versions``, on the link's thread)."""
        self.joined_lineages: dict[str, str] = dict(progress.lineages)
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
        if not self.inbox.arrive(fragment, version, base_version, value, contributors):
            self.reconnect()  # "you hold it already", but we claimed nothing: resync

    def on_request(self, fragment: int, version: int) -> None:
        self.inbox.request(fragment)

    def on_versions(self, address: str, versions: list[int], dropped=()) -> None:
        """How many versions this learner lacks of the fragment it is furthest behind on,
        against the versions a syncer (shard) just reported (``pacing.versions_missing``);
        the uploads it says it left out of their merges go to the training thread."""
        if dropped:
            self.inbox.dropped(Dropped(address, frozenset(dropped)))
        if not versions:  # (a note that came with a version's download)
            return
        have = self.inbox.have_versions(self.progress.versions)
        missing = [versions_missing(v, have[p]) for p, v in enumerate(versions[: len(have)])]
        self.down_lags[address] = max((m for m in missing if m is not None), default=0)

    def on_result(self, job: UploadJob, result: UploadResult) -> None:
        if result.outcome == "accepted" and self.delivery is not None:
            try:
                self.delivery.record(job.fragment, job.local_step)
            except OSError as exc:  # a full disk must not stop training; a restore may resend
                log.warning("delivery log %s: %s", self.delivery.path, exc)
        self.inbox.answer(job, result)

    def on_rejoin(
        self,
        address: str,
        syncer_id: str,
        versions: list[int],
        fragments,
        committed=(),
        logged_from=(),
        lineage: str = "",
        fates: HeldFates | None = None,
    ) -> None:
        """A syncer of another lineage than the one held (``settling.another_lineage``):
        its fragments take a rebase keyframe (``Inbox.restart``, before the subscription
        that follows asks for what it lacks)."""
        log.info(
            "learner %s joined %s (syncer %s): fragments %s at versions %s",
            self.learner_id,
            address,
            syncer_id,
            list(fragments),
            list(versions),
        )
        held = self.inbox.have_versions(self.progress.versions)
        known = self.joined_lineages.get(address)
        another = another_lineage(known, lineage, held, list(versions), tuple(fragments))
        if lineage:
            self.joined_lineages[address] = lineage
        if another:
            log.warning(
                "learner %s: %s serves another lineage (%s, was %s; versions %s, held %s): "
                "its accepted uploads there count as unknown, it takes keyframes",
                self.learner_id,
                address,
                lineage or "not said",
                known or "not known",
                list(versions),
                held,
            )
            self.inbox.restart(fragments)
        self.inbox.rejoin(
            Rejoin(
                address,
                syncer_id,
                list(versions),
                tuple(fragments),
                frozenset(committed),
                tuple(logged_from),
                lineage,
                another,
                fates,
            )
        )

    def have_versions(self) -> list[int]:
        """What this learner will hold once it applied what arrived (the syncer sends deltas
        on top of it); -1 for a fragment that needs a keyframe."""
        return self.inbox.have_versions(self.progress.versions)

    def have_digests(self) -> list[str]:
        """Digests of the fragments never received, with a copy of the values they cover: a
        learner built from the same initialization as the syncer's model (the usual start)
        then downloads nothing at join. Called by the link at each subscription."""
        digests = []
        with torch.no_grad():
            for p in range(self.layout.num_fragments):
                if self.progress.versions[p] >= 0 or self.inbox.needs_keyframe(p):
                    digests.append("")
                    continue
                value = self.layout.gather(p, self.params).detach().clone()
                self.inbox.claim(p, value)
                digests.append(fragment_digest(value))
        return digests

    @property
    def down_lag(self) -> int:
        """Versions this learner lacks of the fragment it is furthest behind on (its downlink's
        lag, as of the last heartbeat; ``DOWNLINK_BEHIND_VERSIONS`` or more: behind)."""
        return max(self.down_lags.values(), default=0)

    def unsettled_from(self) -> list[int]:
        return list(self.progress.unsettled_from)

    def heartbeat_info(self) -> dict:
        sps = 1.0 / self.pacer.step_time if self.pacer.step_time else 0.0
        behind = ["link behind"] if self.pacer.behind else []
        if self.down_lag >= DOWNLINK_BEHIND_VERSIONS:
            behind.append("downlink behind")
        return {
            "step": self.progress.local_step,
            "tokens": self.progress.total_tokens,
            "steps_per_s": sps,
            "state": ", ".join([self.progress.state, *behind]),
        }

"""What a learner saves in its checkpoint and how it comes back from one (``state``,
``load``, dropping what was delivered after the checkpoint): the ``Restorer``, a part the
``Learner`` holds (training thread only)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch

from diloco.algorithm.fragments import FragmentLayout
from diloco.learner.config import LearnerConfig
from diloco.learner.delivery import already_delivered
from diloco.learner.inbox import Inbox, Rejoin
from diloco.learner.journal import UploadJournal, journaled_returns, journaled_uploads
from diloco.learner.ledger import Ledger
from diloco.learner.progress import Progress
from diloco.learner.settling import Settler
from diloco.learner.uploads import UploadJob

log = logging.getLogger(__name__)

DATA = "data"
"""The name a tracked object's state has in the checkpoint unless given another."""


class Stateful(Protocol):
    """What ``Restorer.track`` carries: a data position (``diloco.data.StatefulSampler``,
    ``torchdata``'s ``StatefulDataLoader``) or anything else with these two methods."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Restorer:
    """A learner's checkpoint: what it saves of the ``progress`` and the ``ledger``
    (``state``), loads back (``load``) and, after a restore, what it finds out was delivered
    after the checkpoint (``drop_delivered``, ``confirm_at_join``). Given: the ``inbox``
    (fragments waiting for a rebase keyframe ask again), the ``settler`` (what it returns to
    the undelivered progress goes through ``Settler.give_back``) and ``overwrite`` (the
    learner's ``θ_p ← G_p − Σ ledger``, with ``drops``). It owns what a restore found out."""

    def __init__(
        self,
        progress: Progress,
        ledger: Ledger,
        inbox: Inbox,
        layout: FragmentLayout,
        config: LearnerConfig,
        settler: Settler,
        *,
        overwrite: Callable[..., None],
    ) -> None:
        self.progress, self.ledger, self.inbox = progress, ledger, inbox
        self.layout, self.config, self.settler = layout, config, settler
        self.overwrite = overwrite
        self.dropped_on_restore: list[int] = []
        """Fragments whose checkpointed progress was found delivered already at restore."""
        self.ahead_on_restore = 0
        """Steps past its checkpoint that the previous life trained and delivered some of
        (at the first join the syncer's commits, or without an upload journal its delivery
        log, show an upload queued after the checkpoint's step): training them again would
        merge their data twice; the caller skips them (``skip``, after ``wait_for_global``)."""
        self.unconfirmed: dict[int, tuple[int, int, int]] = {}
        """After a restore: upload id -> (fragment, steps, step) of the uploads queued after
        the checkpoint whose fates this life cannot know (``note_unconfirmed``);
        checked at the first join of their syncer (shard), given up at the first step."""
        self.restored_at: tuple[int, list[int], list[int]] = (0, [], [])
        """After a restore: the checkpoint's step, per-fragment unsent steps and versions."""
        self.checkpoint_life: str | None = None
        """After a restore: the journal's id of the life that took the checkpoint."""
        self.tracked: dict[str, Stateful] = {}
        """The script's own objects whose state the checkpoint carries (``track``)."""
        self.untracked_states: dict[str, dict] = {}
        """After a restore: the states of tracked objects not yet given back (``track``)."""

    def track(self, obj: Stateful, name: str = DATA) -> None:
        """Carry ``obj``'s state (its data position: a stateful sampler or data loader) in
        this learner's checkpoint under ``name``: ``state`` saves ``obj.state_dict()`` with
        the learner's own, and a restored learner gives it back with ``obj.load_state_dict``
        (at once if the checkpoint holds one, else at the restore). Any object with both
        methods will do; ``TypeError`` otherwise, ``ValueError`` for a name tracked already."""
        if not callable(getattr(obj, "state_dict", None)) or not callable(
            getattr(obj, "load_state_dict", None)
        ):
            raise TypeError(f"track: {type(obj).__name__} has no state_dict/load_state_dict")
        if name in self.tracked:
            raise ValueError(f"track: {name!r} is tracked already")
        self.tracked[name] = obj
        if name in self.untracked_states:
            obj.load_state_dict(self.untracked_states.pop(name))

    def skip(self, steps: int, tokens: int) -> None:
        """Count ``steps`` steps of ``tokens`` tokens as trained by this learner's previous
        life and not trained again (after a restore, ``ahead_on_restore`` of them; the caller
        draws the same batches from its data and drops them). The step counter moves on; each
        fragment counts them ``dropped``: the previous life delivered them (the syncer's tape
        holds them under its uploads) or they died with it. Call before the first ``step``."""
        pr = self.progress
        if steps < 0 or tokens < 0:
            raise ValueError(f"skip: steps and tokens must be >= 0, got {steps}, {tokens}")
        self.give_up_unconfirmed()
        if not steps:
            return
        pr.local_step += steps
        pr.total_tokens += tokens
        for p in range(self.layout.num_fragments):
            pr.dropped[p] += steps
        if pr.journal is not None:
            pr.journal.skipped(steps, pr.local_step)

    def open_journal(self, state: dict | None) -> UploadJournal | None:
        """This life's upload journal (``config.journal_file``; none without one). A restored
        life first takes back what a later life had back (``take_back_returned``: whatever
        the delivery log), writes what its checkpoint holds as delivered (``carried``) and
        notes the uploads queued after the checkpoint that it must check at the first join."""
        pr = self.progress
        path = self.config.journal_file
        if not path:
            return None
        carried = None
        if state is not None:
            self.take_back_returned()  # (with or without a delivery log)
            carried = self.settler.delivered_steps()
            self.note_unconfirmed(journaled_uploads(path, state.get("journal_life")))
        return UploadJournal(path, pr.local_step, carried, list(pr.unknown_steps))

    def state(self) -> dict:
        """What a restarted learner needs to carry on (``Learner.state_dict``, which settles
        and makes the deltas still being copied first): global values held, versions, the
        lineage they belong to, counters, the ledger of deltas on their way, the step."""
        pr = self.progress
        return {
            "local_step": pr.local_step,
            "total_tokens": pr.total_tokens,
            "versions": list(pr.versions),
            "steps_since": list(pr.steps_since),
            "tokens_since": list(pr.tokens_since),
            "residual": sorted(pr.residual),
            "anchors": [a.clone() if a is not None else torch.empty(0) for a in pr.anchors],
            "ledger": self.ledger.state(),
            "merged_steps": list(pr.merged_steps),
            "dropped": list(pr.dropped),
            "excluded_steps": list(pr.excluded_steps),
            "unknown_steps": list(pr.unknown_steps),
            "syncer_ids": dict(pr.syncer_ids),
            "lineages": dict(pr.lineages),
            "rebasing": sorted(pr.rebasing),
            "journal_life": pr.journal.life if pr.journal is not None else None,
            "layout_hash": self.layout.hash,
            "tracked": {name: obj.state_dict() for name, obj in self.tracked.items()},
        }

    def drop_delivered(self, accepted_at: dict[int, int]) -> None:
        """After a restore, what the delivery log (``accepted_at``) says of the time after
        the checkpoint. Accepted is not merged: an accepted upload's round may die with its
        syncer, or leave it out. With an upload journal the first join of each syncer
        decides from its commits (``confirm_delivered``; a delta a later life had back is
        undelivered progress again: ``open_journal``). Without one, the log is all there
        is: a delta without an upload id that an upload accepted at or after it may have
        carried, and the checkpointed progress of a fragment whose upload queued after the
        checkpoint was accepted, are neither sent again nor counted merged but counted
        *unknown*; the steps the log shows past the checkpoint are skipped."""
        pr = self.progress
        journaled = bool(self.config.journal_file)
        with torch.no_grad():
            for p, e in self.ledger.items():
                if e.admitted is not None or e.upload_id:
                    continue  # (one with an upload id is sent again as it was: resumed)
                if accepted_at.get(p, -1) >= e.local_step:
                    self.settler.forget_unknown(p, e)  # (no id: no syncer can tell)
                else:
                    self.settler.give_back(p, e)
            if journaled:
                return
            for p in already_delivered(accepted_at, pr.local_step, pr.steps_since):
                if pr.anchors[p] is None:
                    continue
                pr.unknown_steps[p] += pr.steps_since[p]  # accepted: maybe merged, maybe not
                self.overwrite(p, pr.anchors[p], drops=False)
                self.dropped_on_restore.append(p)
        self.ahead_on_restore = max(0, max(accepted_at.values(), default=0) - pr.local_step)

    def take_back_returned(self) -> None:
        """After a restore: a delta the checkpoint holds unanswered that the journal says a
        later life had back (refused or withdrawn after the checkpoint: ``returned``) is not
        sent again as it was: that life sent its steps again, in its next upload of the
        fragment (found by the widened torture run: a resend refused again was returned and
        its steps merged twice). Its steps are undelivered progress again, as they were for
        that life (its delta stays in θ_p), which the first join judges like the rest
        (``confirm_delivered``): not sent again if the syncer's commits hold that next
        upload."""
        pr, path = self.progress, self.config.journal_file
        returns = journaled_returns(path, self.checkpoint_life) if path else {}
        for p, e in self.ledger.items():
            if e.admitted is not None or e.upload_id not in returns or pr.anchors[p] is None:
                continue
            self.ledger.remove(p, e)
            pr.steps_since[p] += e.steps
            pr.tokens_since[p] += e.tokens

    def note_unconfirmed(self, journaled: list[tuple[int, int, int, int]]) -> None:
        """After a restore: remember the uploads (``journaled``: id, fragment, steps, step;
        of the life that took the checkpoint and any later one) queued after the
        checkpoint. Whether the syncer accepted one (an answer the delivery log may have
        seen) says nothing of its fate: the first join of its syncer (shard) tells, by its
        commit list (``confirm_delivered``)."""
        pr = self.progress
        step, since = pr.local_step, list(pr.steps_since)
        self.restored_at = (step, since, list(pr.versions))
        on_ledger = {e.upload_id for p, e in self.ledger.items() if e.upload_id}
        self.unconfirmed = {
            u: (p, steps, at)
            for u, p, steps, at in journaled
            if 0 <= p < len(since) and at > step and u not in on_ledger
        }

    def confirm_at_join(self, rejoin: Rejoin) -> None:
        """At every join: the first one of a syncer (shard) after a restore confirms what
        the previous life delivered (``confirm_delivered``); later ones change nothing."""
        if self.unconfirmed:
            self.confirm_delivered(rejoin)

    def confirm_delivered(self, rejoin: Rejoin) -> None:
        """At the first join of a syncer (shard owning ``fragments``) after a restore: the
        uploads of those fragments queued after the checkpoint that its commits hold were
        delivered. ``ahead_on_restore`` covers the steps they reached; a fragment whose
        checkpointed progress one of them carried (its steps reach back over the unsent
        window) has that progress settled by its fate, unless this life has moved it already
        (it trained or sent it). The join reply tells the fates of the ids it holds
        (``Rejoin.fates``): one merged or left out has the progress dropped as delivered
        (counted merged or excluded), one in a round still open has it put on the ledger as
        that upload in flight (``Settler.keep_in_flight``: merged when the commit comes,
        sent again if the syncer dies first); from a syncer that does not tell them apart
        (it predates ``fates``), a held one counts *unknown* like one older than its logs,
        never merged. One its commits do not hold was never
        committed only if its admission is not older than the logs the syncer keeps
        (``logged_from``; it was made against a version at least the checkpoint's): its
        progress stays undelivered (trained and sent again, even if the delivery log saw it
        accepted: its round died). Else its fate is unknown, and it is treated as delivered
        (its steps skipped, the progress it may have carried dropped) but counted
        *unknown*. So is every one checked against another lineage (a state directory
        rolled back or replaced): its logs and commits say nothing of this one's."""
        pr = self.progress
        step, since, held = self.restored_at
        fates, logged_from = rejoin.fates, rejoin.logged_from
        mine = {u: v for u, v in self.unconfirmed.items() if v[0] in set(rejoin.fragments)}
        for u in mine:
            del self.unconfirmed[u]
        for upload_id, (p, steps, at) in sorted(mine.items(), key=lambda kv: kv[1]):
            logged = logged_from[p] if p < len(logged_from) else -1
            unheld = upload_id not in rejoin.committed
            if (
                unheld
                and not rejoin.another_lineage
                and 0 <= logged <= max(held[p] if p < len(held) else -1, 0)
            ):
                continue  # its admission is within the kept logs: never committed
            self.ahead_on_restore = max(self.ahead_on_restore, at - step)
            carried = at - steps <= step - since[p]  # it reached back over the unsent window
            untouched = pr.steps_since[p] == since[p] > 0 and p not in self.dropped_on_restore
            if not (carried and untouched and pr.anchors[p] is not None):
                continue
            # (a syncer that predates ``fates`` may list an upload of a round still open)
            unknown = unheld or fates is None or rejoin.another_lineage
            if not unknown and upload_id in fates.open:
                self.settler.keep_in_flight(p, upload_id, fates.open[upload_id], rejoin, at)
                continue
            if unknown:
                pr.unknown_steps[p] += since[p]  # maybe delivered before the restart
            elif upload_id in fates.excluded:
                pr.excluded_steps[p] += since[p]
                pr.counters["excluded"] += 1
            else:
                self.settler.count_merged_upload(p, upload_id, since[p])
            self.drop_carried(p, unknown=unknown)

    def drop_carried(self, p: int, *, unknown: bool) -> None:
        """Fragment ``p``'s checkpointed progress was carried by an upload of an earlier
        life (counted by the caller): θ_p goes back to its anchor (``overwrite``, nothing
        counted dropped) and the journal says so (``unknown``: its fate is not known)."""
        pr = self.progress
        with torch.no_grad():
            self.overwrite(p, pr.anchors[p], drops=False)
        self.dropped_on_restore.append(p)
        if pr.journal is not None:
            pr.journal.found_delivered(p, self.restored_at[1][p], unknown=unknown)

    def give_up_unconfirmed(self) -> None:
        """Training starts before every syncer (shard) answered the first join (its wait
        timed out: ``Waiter.wait_for_global``; else the first ``step`` or ``skip``). A join
        already waiting in the inbox is settled first (``confirm_at_join``). Every upload
        still unconfirmed is of unknown fate, never guessed: the steps it reached past the
        checkpoint count in ``ahead_on_restore`` (the caller skips them), and the
        checkpointed progress it may have carried, if this life has not moved it, is neither
        merged nor sent again but counted *unknown* (``drop_carried``). Called from ``step``,
        that step's update of such a fragment goes with its progress (the step is counted
        unsent all the same): call ``wait_for_global`` before training."""
        if not self.unconfirmed:
            return
        self.settler.settle()  # (a join that arrived after the timeout still counts)
        if not self.unconfirmed:
            return
        pr = self.progress
        step, since, _ = self.restored_at
        for p, steps, at in sorted(self.unconfirmed.values(), key=lambda v: v[2]):
            self.ahead_on_restore = max(self.ahead_on_restore, at - step)
            carried = at - steps <= step - since[p]
            untouched = pr.steps_since[p] == since[p] > 0 and p not in self.dropped_on_restore
            if carried and untouched and pr.anchors[p] is not None:
                pr.unknown_steps[p] += since[p]
                self.drop_carried(p, unknown=True)
        log.warning(
            "%d uploads of the previous life (fragments %s) were not confirmed before "
            "training resumed (no join yet): their fates are unknown; the checkpointed "
            "progress they may have carried is not sent again (counted unknown) and %d "
            "steps past the checkpoint are to be skipped",
            len(self.unconfirmed),
            sorted({p for p, _, _ in self.unconfirmed.values()}),
            self.ahead_on_restore,
        )
        self.unconfirmed = {}

    def resume_unanswered(self, link) -> None:
        """After a restore: deltas the checkpoint holds without an answer are sent again as
        they were, with their upload ids and marked as resends, so the syncer answers one it
        accepted before with its first verdict (or ``fate_unknown`` once it no longer keeps
        that commit's log) and merges one it never saw once. A delta from before upload ids
        (id 0) is returned to the undelivered progress. Each one resent is journaled again
        by this life: its steps are this life's to account for, and the audit finds them
        under the newest life that journaled the id."""
        pr = self.progress
        for p, e in self.ledger.items():
            if e.admitted is not None:
                continue
            if not e.upload_id:
                self.settler.give_back(p, e)
                continue
            # (an entry from before base versions were kept: 0, so a syncer that no longer
            # keeps the logs of the versions since answers fate_unknown, never "new")
            base = max(e.base_version, 0)
            job = UploadJob(
                p,
                base,
                e.steps,
                e.tokens,
                e.delta,
                0.0,
                e.local_step,
                job_id=e.job_id,
                upload_id=e.upload_id,
                attempts=1,  # sent by an earlier life, unanswered: a resend
                on_the_wire=True,
            )
            if pr.journal is not None:
                pr.journal.queued(e.upload_id, p, e.steps, e.tokens, e.local_step)
            link.resume(job)

    def load(self, state: dict) -> None:
        """Take back a ``state`` (``Learner.load_state_dict``); ``ValueError`` if it belongs
        to another model or fragmentation (then nothing changed)."""
        if state.get("layout_hash") != self.layout.hash:
            raise ValueError("this learner state belongs to another model or fragmentation")
        P = self.layout.num_fragments
        if len(state["versions"]) != P or len(state["anchors"]) != P:
            raise ValueError(f"learner state has {len(state['versions'])} fragments, expected {P}")
        pr = self.progress
        pr.local_step = int(state["local_step"])
        pr.total_tokens = int(state["total_tokens"])
        self.checkpoint_life = state.get("journal_life")
        pr.versions = [int(v) for v in state["versions"]]
        pr.steps_since = [int(v) for v in state["steps_since"]]
        pr.tokens_since = [int(v) for v in state["tokens_since"]]
        pr.residual = {int(p) for p in state.get("residual", ()) if 0 <= int(p) < P}
        pr.anchors = [
            a.clone() if v >= 0 and a.numel() == self.layout.fragments[p].numel else None
            for p, (a, v) in enumerate(zip(state["anchors"], pr.versions, strict=True))
        ]
        pr.versions = [v if pr.anchors[p] is not None else -1 for p, v in enumerate(pr.versions)]
        self.ledger.load(state.get("ledger", []), [f.numel for f in self.layout.fragments])
        pr.merged_steps = [int(v) for v in state.get("merged_steps", [0] * P)]
        pr.dropped = [int(v) for v in state.get("dropped", [0] * P)]
        pr.excluded_steps = [int(v) for v in state.get("excluded_steps", [0] * P)]
        pr.unknown_steps = [int(v) for v in state.get("unknown_steps", [0] * P)]
        pr.syncer_ids = {str(k): str(v) for k, v in state.get("syncer_ids", {}).items()}
        pr.lineages = {str(k): str(v) for k, v in state.get("lineages", {}).items()}
        pr.rebasing = {int(p) for p in state.get("rebasing", ()) if 0 <= int(p) < P}
        self.inbox.restart(pr.rebasing)  # (its keyframe had not come: it is asked again)
        self.untracked_states = dict(state.get("tracked", {}))
        for name, obj in self.tracked.items():
            if name in self.untracked_states:
                obj.load_state_dict(self.untracked_states.pop(name))

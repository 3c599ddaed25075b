"""What a learner saves in its checkpoint and how it comes back from one (``state_dict``,
``load_state_dict``, dropping what was delivered after the checkpoint; a mixin of
``Learner``)."""

from __future__ import annotations

import logging

import torch

from diloco.learner.delivery import already_delivered
from diloco.learner.journal import UploadJournal, journaled_returns, journaled_uploads
from diloco.learner.uploads import UploadJob

log = logging.getLogger(__name__)


class Restoring:
    """The checkpoint half of ``diloco.learner.learner.Learner``."""

    def _init_restoring(self) -> None:
        """What a restore finds out (set by ``__init__``, before any restore)."""
        self.dropped_on_restore: list[int] = []
        """Fragments whose checkpointed progress was found delivered already at restore."""
        self.ahead_on_restore = 0
        """Steps past its checkpoint that the previous life trained and delivered some of
        (its delivery log, or at the first join the syncer's commits, show an upload
        queued after the checkpoint's step): training them again would merge their data
        twice; the caller skips them (``skip``, after ``wait_for_global``)."""
        self._unconfirmed: dict[int, tuple[int, int, int]] = {}
        """After a restore: upload id -> (fragment, steps, step) of the uploads queued after
        the checkpoint whose answers this life cannot know (``Restoring._note_unconfirmed``);
        checked at the first join of their syncer (shard), given up at the first step."""
        self._restored_at: tuple[int, list[int], list[int]] = (0, [], [])
        """After a restore: the checkpoint's step, per-fragment unsent steps and versions."""
        self._checkpoint_life: str | None = None
        """After a restore: the journal's id of the life that took the checkpoint."""

    def skip(self, steps: int, tokens: int) -> None:
        """Count ``steps`` steps of ``tokens`` tokens as trained by this learner's previous
        life and not trained again (after a restore, ``ahead_on_restore`` of them; the caller
        draws the same batches from its data and drops them). The step counter moves on; each
        fragment counts them ``dropped``: the previous life delivered them (the syncer's tape
        holds them under its uploads) or they died with it. Call before the first ``step``."""
        if steps < 0 or tokens < 0:
            raise ValueError(f"skip: steps and tokens must be >= 0, got {steps}, {tokens}")
        self._give_up_unconfirmed()
        if not steps:
            return
        self.local_step += steps
        self.total_tokens += tokens
        for p in range(self.layout.num_fragments):
            self.dropped[p] += steps
        if self.journal is not None:
            self.journal.skipped(steps, self.local_step)

    def _open_journal(self, state: dict | None) -> UploadJournal | None:
        """This life's upload journal (``config.journal_file``; none without one). A restored
        life writes what its checkpoint holds as delivered (``carried``) and notes the
        uploads queued after the checkpoint that it must check at the first join."""
        path = self.config.journal_file
        if not path:
            return None
        carried = None
        if state is not None:
            carried = self.delivered_steps()
            self._note_unconfirmed(journaled_uploads(path, state.get("journal_life")))
        return UploadJournal(path, self.local_step, carried, list(self.unknown_steps))

    def state_dict(self) -> dict:
        """What a restarted learner needs to carry on: global values held, versions, the
        lineage they belong to, counters, the ledger of deltas on their way, the step.

        Save it with the model and the inner optimizer (``torch.save``; load with
        ``weights_only=True``) and pass it back as ``Learner(..., state=...)``: the learner
        then resubscribes with these versions and only receives fragments that moved on.
        """
        self._settle()
        self._send_copied(wait=True)  # on the ledger: a checkpoint holds it
        return {
            "local_step": self.local_step,
            "total_tokens": self.total_tokens,
            "versions": list(self.versions),
            "steps_since": list(self.steps_since),
            "tokens_since": list(self.tokens_since),
            "residual": sorted(self._residual),
            "anchors": [a.clone() if a is not None else torch.empty(0) for a in self.anchors],
            "ledger": self._ledger.state(),
            "merged_steps": list(self.merged_steps),
            "dropped": list(self.dropped),
            "excluded_steps": list(self.excluded_steps),
            "unknown_steps": list(self.unknown_steps),
            "syncer_ids": dict(self._syncer_ids),
            "lineages": dict(self.lineages),
            "rebasing": sorted(self._rebasing),
            "journal_life": self.journal.life if self.journal is not None else None,
            "layout_hash": self.layout.hash,
        }

    def _drop_delivered(self, accepted_at: dict[int, int]) -> None:
        """After a restore: deltas whose answer the checkpoint did not know count as
        delivered if the delivery log shows an upload of that fragment accepted at or after
        them (else they are returned and sent again); the undelivered progress of a fragment
        whose upload queued after the checkpoint was accepted is dropped (delivered)."""
        with torch.no_grad():
            for p, e in self._ledger.items():
                if e.admitted is not None or e.upload_id:
                    continue  # (one with an upload id is sent again as it was: resumed)
                if accepted_at.get(p, -1) >= e.local_step:
                    e.admitted = -1  # merged by the first version that arrives
                else:
                    self._return(p, e)
            for p in already_delivered(accepted_at, self.local_step, self.steps_since):
                if self.anchors[p] is None:
                    continue
                self.merged_steps[p] += self.steps_since[p]  # delivered before the restart
                self._overwrite(p, self.anchors[p], drops=False)
                self.dropped_on_restore.append(p)
            self._take_back_returned(accepted_at)
        self.ahead_on_restore = max(0, max(accepted_at.values(), default=0) - self.local_step)

    def _take_back_returned(self, accepted_at: dict[int, int]) -> None:
        """After a restore: a delta the checkpoint holds unanswered that the journal says a
        later life had back (refused or withdrawn after the checkpoint: ``returned``) is not
        sent again as it was: that life sent its steps again, in its next upload of the
        fragment (found by the widened torture run: a resend refused again was returned and
        its steps merged twice). Delivered when the delivery log shows an upload of the
        fragment accepted from that next one on (its steps count merged, the fragment goes
        back to its anchor); else its steps are undelivered progress again, as they were for
        that life, which the first join judges like the rest (``_confirm_delivered``)."""
        path = self.config.journal_file
        returns = journaled_returns(path, self._checkpoint_life) if path else {}
        for p, e in self._ledger.items():
            if e.admitted is not None or e.upload_id not in returns or self.anchors[p] is None:
                continue
            self._ledger.remove(p, e)
            next_at = returns[e.upload_id]
            if next_at is not None and accepted_at.get(p, -1) >= next_at:
                self.merged_steps[p] += e.steps  # delivered before the restart
                self._overwrite(p, self.anchors[p], drops=False)  # (θ_p held e's delta)
                if p not in self.dropped_on_restore:
                    self.dropped_on_restore.append(p)
            else:  # its delta stays in θ_p: undelivered progress
                self.steps_since[p] += e.steps
                self.tokens_since[p] += e.tokens

    def _note_unconfirmed(self, journaled: list[tuple[int, int, int, int]]) -> None:
        """After a restore: remember the uploads (``journaled``: id, fragment, steps, step;
        of the life that took the checkpoint and any later one) queued after the
        checkpoint. One the syncer accepted just before the life died has no answer
        anywhere (neither the checkpoint nor the delivery log saw it): the first join of
        its syncer (shard) tells, by its commit list (``_confirm_delivered``)."""
        step, since = self.local_step, list(self.steps_since)
        self._restored_at = (step, since, list(self.versions))
        on_ledger = {e.upload_id for p, e in self._ledger.items() if e.upload_id}
        self._unconfirmed = {
            u: (p, steps, at)
            for u, p, steps, at in journaled
            if 0 <= p < len(since) and at > step and u not in on_ledger
        }

    def _confirm_delivered(
        self, committed: frozenset[int], fragments: tuple[int, ...], logged_from=()
    ) -> None:
        """At the first join of a syncer (shard owning ``fragments``) after a restore: the
        uploads of those fragments queued after the checkpoint that its commits hold were
        delivered. ``ahead_on_restore`` covers the steps they reached; a fragment whose
        checkpointed progress one of them carried (its steps reach back over the unsent
        window) has that progress dropped as delivered, as ``_drop_delivered`` does from the
        delivery log, unless this life has moved it already (it trained or sent it). One its
        commits do not hold was never committed only if its admission is not older than the
        logs the syncer keeps (``logged_from``; it was made against a version at least the
        checkpoint's): else its fate is unknown, and it is treated as delivered (its steps
        skipped, the progress it may have carried dropped) but counted *unknown*."""
        step, since, held = self._restored_at
        owned = set(fragments)
        mine = {u: v for u, v in self._unconfirmed.items() if v[0] in owned}
        for u in mine:
            del self._unconfirmed[u]
        for upload_id, (p, steps, at) in sorted(mine.items(), key=lambda kv: kv[1]):
            logged = logged_from[p] if p < len(logged_from) else -1
            unknown = upload_id not in committed
            if unknown and 0 <= logged <= max(held[p] if p < len(held) else -1, 0):
                continue  # its admission is within the kept logs: never committed
            self.ahead_on_restore = max(self.ahead_on_restore, at - step)
            carried = at - steps <= step - since[p]  # it reached back over the unsent window
            untouched = self.steps_since[p] == since[p] > 0 and p not in self.dropped_on_restore
            if carried and untouched and self.anchors[p] is not None:
                column = self.unknown_steps if unknown else self.merged_steps
                column[p] += since[p]  # delivered before the restart, or maybe
                with torch.no_grad():
                    self._overwrite(p, self.anchors[p], drops=False)
                self.dropped_on_restore.append(p)
                if self.journal is not None:
                    self.journal.found_delivered(p, since[p], unknown=unknown)

    def _give_up_unconfirmed(self) -> None:
        """Training starts before every syncer (shard) answered the first join: what its
        commits would have said can no longer be applied (this life moved on). Said once,
        with what may reach the global model twice."""
        if not self._unconfirmed:
            return
        fragments = sorted({p for p, _, _ in self._unconfirmed.values()})
        log.warning(
            "%d uploads of the previous life (fragments %s) were not confirmed before "
            "training resumed (no join yet): if the syncer had accepted them, their steps "
            "may be merged twice",
            len(self._unconfirmed),
            fragments,
        )
        self._unconfirmed = {}

    def _resume_unanswered(self) -> None:
        """After a restore: deltas the checkpoint holds without an answer are sent again as
        they were, with their upload ids and marked as resends, so the syncer answers one it
        accepted before with its first verdict (or ``fate_unknown`` once it no longer keeps
        that commit's log) and merges one it never saw once. A delta from before upload ids
        (id 0) is returned to the undelivered progress. Each one resent is journaled again
        by this life: its steps are this life's to account for, and the audit finds them
        under the newest life that journaled the id."""
        for p, e in self._ledger.items():
            if e.admitted is not None:
                continue
            if not e.upload_id:
                self._return(p, e)
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
            if self.journal is not None:
                self.journal.queued(e.upload_id, p, e.steps, e.tokens, e.local_step)
            self.link.resume(job)

    def load_state_dict(self, state: dict) -> None:
        if state.get("layout_hash") != self.layout.hash:
            raise ValueError("this learner state belongs to another model or fragmentation")
        P = self.layout.num_fragments
        if len(state["versions"]) != P or len(state["anchors"]) != P:
            raise ValueError(f"learner state has {len(state['versions'])} fragments, expected {P}")
        self.local_step = int(state["local_step"])
        self.total_tokens = int(state["total_tokens"])
        self._checkpoint_life = state.get("journal_life")
        self.versions = [int(v) for v in state["versions"]]
        self.steps_since = [int(v) for v in state["steps_since"]]
        self.tokens_since = [int(v) for v in state["tokens_since"]]
        self._residual = {int(p) for p in state.get("residual", ()) if 0 <= int(p) < P}
        self.anchors = [
            a.clone() if v >= 0 and a.numel() == self.layout.fragments[p].numel else None
            for p, (a, v) in enumerate(zip(state["anchors"], self.versions, strict=True))
        ]
        self.versions = [
            v if self.anchors[p] is not None else -1 for p, v in enumerate(self.versions)
        ]
        self._ledger.load(state.get("ledger", []), [f.numel for f in self.layout.fragments])
        self.merged_steps = [int(v) for v in state.get("merged_steps", [0] * P)]
        self.dropped = [int(v) for v in state.get("dropped", [0] * P)]
        self.excluded_steps = [int(v) for v in state.get("excluded_steps", [0] * P)]
        self.unknown_steps = [int(v) for v in state.get("unknown_steps", [0] * P)]
        self._syncer_ids = {str(k): str(v) for k, v in state.get("syncer_ids", {}).items()}
        self.lineages = {str(k): str(v) for k, v in state.get("lineages", {}).items()}
        self._rebasing = {int(p) for p in state.get("rebasing", ()) if 0 <= int(p) < P}
        self._inbox.restart(self._rebasing)  # (its keyframe had not come: it is asked again)

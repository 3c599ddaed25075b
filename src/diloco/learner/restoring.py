"""What a learner saves in its checkpoint and how it comes back from one (``state_dict``,
``load_state_dict``, dropping what was delivered after the checkpoint; a mixin of
``Learner``)."""

from __future__ import annotations

import torch

from diloco.learner.delivery import already_delivered
from diloco.learner.uploads import UploadJob


class Restoring:
    """The checkpoint half of ``diloco.learner.learner.Learner``."""

    def state_dict(self) -> dict:
        """What a restarted learner needs to carry on: global values held, versions,
        counters, the ledger of deltas on their way, the step.

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
            "syncer_ids": dict(self._syncer_ids),
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
        self.ahead_on_restore = max(0, max(accepted_at.values(), default=0) - self.local_step)

    def _note_unconfirmed(self, journaled: list[tuple[int, int, int]]) -> None:
        """After a restore: remember the previous lives' uploads (``journaled``: id,
        fragment, step) queued after the checkpoint's unsent window of their fragment began.
        One the syncer accepted just before the life died has no answer anywhere (neither
        the checkpoint nor the delivery log saw it): the first join's commit list tells
        (``_confirm_delivered``)."""
        step, since = self.local_step, list(self.steps_since)
        self._restored_at = (step, since)
        on_ledger = {e.upload_id for p, e in self._ledger.items() if e.upload_id}
        self._unconfirmed = {
            u: (p, at)
            for u, p, at in journaled
            if 0 <= p < len(since) and at > step - since[p] and u not in on_ledger
        }

    def _confirm_delivered(self, committed: frozenset[int]) -> None:
        """At the first join after a restore: the previous lives' uploads that the syncer's
        commits hold were delivered. A fragment whose checkpointed progress one of them
        carried has it dropped as delivered (as ``_drop_delivered`` does from the delivery
        log), and ``ahead_on_restore`` covers the steps they reached past the checkpoint."""
        unconfirmed, self._unconfirmed = self._unconfirmed, {}
        step, since = self._restored_at
        for upload_id, (p, at) in sorted(unconfirmed.items(), key=lambda kv: kv[1]):
            if upload_id not in committed:
                continue
            self.ahead_on_restore = max(self.ahead_on_restore, at - step)
            untouched = self.steps_since[p] == since[p] > 0 and p not in self.dropped_on_restore
            if untouched and self.anchors[p] is not None and not self._ledger.of(p):
                self.merged_steps[p] += since[p]  # delivered before the restart
                with torch.no_grad():
                    self._overwrite(p, self.anchors[p], drops=False)
                self.dropped_on_restore.append(p)
                if self.journal is not None:
                    self.journal.found_delivered(p, since[p])

    def _resume_unanswered(self) -> None:
        """After a restore: deltas the checkpoint holds without an answer are sent again as
        they were, with their upload ids, so the syncer answers one it accepted before with
        its first verdict and merges one it never saw once. A delta from before upload ids
        (id 0) is returned to the undelivered progress. Each one resent is journaled again
        by this life: its steps are this life's to account for, and the audit finds them
        under the newest life that journaled the id."""
        for p, e in self._ledger.items():
            if e.admitted is not None:
                continue
            if not e.upload_id:
                self._return(p, e)
                continue
            base = e.base_version if e.base_version >= 0 else self.versions[p]
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
        self._syncer_ids = {str(k): str(v) for k, v in state.get("syncer_ids", {}).items()}

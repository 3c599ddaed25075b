"""How the syncer closes a round and commits it: which contributions the merge keeps (the
direction check), their weights and share, and the commit with its log.

A part :class:`diloco.syncer.state.SyncerState` holds (``state.closing``): the state decides
*when* a round closes (``close_rounds``) and hands it over, this part *how*. It owns what
the commits leave behind: each fragment's last commit logs (``history``), the tokens merged
(``merged_tokens``), when each fragment last committed (``last_commit_at``) and which
fragments are being merged (``merging``); it moves the global model
(``diloco.syncer.model``) and asks the learner table (``diloco.syncer.roster``) who counts
for a round's share and what the direction check said of each learner before.

A closed round becomes a ``Closing`` under the syncer's lock; its merge (the costly part)
runs outside it; ``apply`` then takes the outer step, bumps the version and returns the
``Commit`` with the ``CommitLog`` of what the round merged and left out, which is persisted
with the commit (``diloco.syncer.receipts``).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Collection, Sequence

import torch

from diloco.algorithm.direction import consensus_cosines, secret_generator
from diloco.algorithm.fragments import FragmentLayout
from diloco.algorithm.merge import cap_weights, is_embedding_name
from diloco.algorithm.outer import round_share, scheduled_outer_lr
from diloco.syncer.config import SyncerConfig
from diloco.syncer.model import GlobalModel
from diloco.syncer.receipts import PERSISTED_COMMITS, CommitLog
from diloco.syncer.records import Closing, Commit, Contribution, FragmentRound, is_suspect
from diloco.syncer.replay import RoundInputs
from diloco.syncer.roster import LearnerRoster


class RoundClosing:
    """Close rounds and commit them (see the module docstring). Not thread-safe: callers
    hold the state's lock."""

    def __init__(
        self,
        config: SyncerConfig,
        layout: FragmentLayout,
        model: GlobalModel,
        roster: LearnerRoster,
        *,
        served: Sequence[int],
        embeddings: Collection[str] | None,
        wall_of: Callable[[float], float],
    ) -> None:
        """``served``: the fragments this syncer owns; ``embeddings``: the parameter names
        merged by weighted mean (None: the name rule ``merge.is_embedding_name``);
        ``wall_of``: the wall time its records carry for a ``now``."""
        self.config = config
        self.layout = layout
        self.model = model
        self.roster = roster
        self.embeddings = frozenset(embeddings) if embeddings is not None else None
        self.wall_of = wall_of
        self.history: dict[int, deque[CommitLog]] = {
            p: deque(maxlen=PERSISTED_COMMITS) for p in served
        }
        """Each fragment's last commit logs: persisted with every commit of it."""
        self.merged_tokens = dict.fromkeys(served, 0)
        """Per owned fragment, the tokens its commits merged since the run began: persisted
        with every commit of it, restored at restart (``restore_history``)."""
        self.last_commit_at: dict[int, float] = {}
        """When each fragment's last commit that changed it was made (``_share``)."""
        self._merging: set[int] = set()
        """Fragments whose round ``close`` took and ``apply`` has not committed yet."""

    def restore_history(
        self, fragment: int, logs: Sequence[CommitLog], merged_tokens: int | None = None
    ) -> None:
        """Take in the commit logs a restored fragment's file holds (oldest first): written
        again with its next commit. ``merged_tokens``: the total persisted with the fragment
        (None, a file written before it was kept: what the logs merged, a lower bound)."""
        self.history[fragment].extend(logs)
        if merged_tokens is None:
            merged_tokens = sum(log.tokens for log in logs)
        self.merged_tokens[fragment] = merged_tokens

    def merging(self, fragment: int) -> bool:
        """Whether a round of ``fragment`` was closed (``close``) and not yet committed
        (``apply``): an upload admitted meanwhile lands in the round after it."""
        return fragment in self._merging

    def is_embedding(self, name: str) -> bool:
        """Merged by weighted mean: every tensor under ``merge_rule="mean"``, else the
        embeddings (RDA for the rest)."""
        if self.config.merge_rule == "mean":
            return True
        if self.embeddings is not None:
            return name in self.embeddings
        return is_embedding_name(name)

    def _share(self, fragment: int, round_: FragmentRound, kept, live: set[str], now) -> float:
        """The factor this round's merged delta is scaled by (``SyncerConfig.outer_scale``).

        An absent live learner that contributed recently (``recent_contributors``) is
        expected to bring what its measured throughput trained since the fragment's previous
        commit (its last contribution's tokens before a throughput is known), at most
        ``weight_cap`` times the round's median contribution: an id that never contributes,
        or one that claims a huge throughput, cannot shrink the others' step."""
        if self.config.outer_scale == "none" or self.config.wait_for_all:
            return 1.0  # a synchronous round holds everyone by construction
        counted = self.roster.recent_contributors(now)
        absent = sorted((live & counted) - set(round_.contributions))
        since = now - self.last_commit_at.get(fragment, now)
        here = [c.tokens for c in kept]  # (a contribution the direction check left out: none)
        most = self.config.weight_cap * statistics.median(here) or float("inf")
        expected = []
        for lid in absent:
            info = self.roster.learners[lid]
            rate = info.tokens_per_s
            guess = rate * since if rate and since > 0 else info.last_tokens
            expected.append(None if guess is None else min(guess, most))
        return round_share(here, expected)

    def _consensus(self, contribs: list[Contribution]) -> tuple[list[Contribution], dict, dict]:
        """``(kept, excluded, cosines)``: the contributions the merge keeps, ``{learner:
        cosine}`` of those it leaves out and of every one (empty when the check did not run).
        In a round of 3 or more, those whose cosine with the round's coordinate-wise median
        is below ``direction_floor`` are left out (all are kept if none would remain), and
        each learner's verdict is remembered; in a smaller round a *suspect* learner
        (``records.is_suspect``) is left out (``"suspect"``), even when that leaves none."""
        floor = self.config.direction_floor
        if floor <= -1.0:
            return contribs, {}, {}
        if len(contribs) < 3:  # too few to check: a suspect learner is left out
            suspects = {c.learner_id for c in contribs if is_suspect(self._verdicts(c.learner_id))}
            kept = [c for c in contribs if c.learner_id not in suspects]
            return kept, dict.fromkeys(sorted(suspects), "suspect"), {}
        cosines = consensus_cosines([c.delta for c in contribs], secret_generator())
        by_id = {c.learner_id: round(cos, 4) for c, cos in zip(contribs, cosines, strict=True)}
        kept = [c for c in contribs if by_id[c.learner_id] >= floor]
        if not kept:
            return contribs, {}, by_id
        for lid, cos in by_id.items():
            self._verdicts(lid).append(cos < floor)
        return kept, {lid: cos for lid, cos in by_id.items() if cos < floor}, by_id

    def _verdicts(self, learner_id: str):
        """The learner's recent direction-check verdicts (empty for an id no longer known)."""
        info = self.roster.learners.get(learner_id)
        return info.verdicts if info is not None else deque()

    def close(
        self, fragment: int, round_: FragmentRound, reason: str, now: float, live: set[str]
    ) -> Closing:
        """``round_`` of ``fragment``, taken out of the open rounds for ``reason``: what its
        merge needs (the contributions the direction check keeps, their capped weights, the
        round's share among the ``live`` learners). Until ``apply`` commits it the fragment
        is ``merging`` (unless nothing is kept: a dropped round keeps the version)."""
        everyone = sorted(round_.contributions.values(), key=lambda c: c.learner_id)
        contribs, excluded, cosines = self._consensus(everyone)
        left_out = [c for c in everyone if c.learner_id in excluded]
        raw = [c.weight if self.config.weighting == "tokens" else c.discount for c in contribs]
        if contribs:  # (a dropped round keeps the version: uploads meanwhile are admitted at it)
            self._merging.add(fragment)
        return Closing(
            fragment,
            round_,
            reason,
            contribs,
            left_out,
            weights=cap_weights(raw, self.config.weight_cap) if contribs else [],
            excluded=excluded,
            cosines=cosines,
            share=self._share(fragment, round_, contribs, live, now) if contribs else 1.0,
            is_embedding=self.is_embedding,
            piece_layout=self.layout.fragments[fragment],
        )

    def apply(self, closing: Closing, merged: torch.Tensor | None, now: float) -> Commit:
        """Take the outer step of a closed round with its merged delta: the new version. A
        dropped round (``merged`` None: the direction check left every contribution out)
        keeps the version and value; its commit only carries the log of what was left out."""
        fragment, round_, contribs = closing.fragment, closing.round, closing.contributions
        self._merging.discard(fragment)
        model = self.model
        admitted = model.versions[fragment]
        log = CommitLog(
            fragment,
            admitted if merged is None else admitted + 1,
            admitted,
            {c.learner_id: list(c.uploads) for c in contribs},
            {c.learner_id: list(c.uploads) for c in closing.left_out},
        )
        self.history[fragment].append(log)  # (its receipts are settled once it is on disk)
        history = [entry.to_json() for entry in self.history[fragment]]
        uploads = {
            "uploads": log.to_json()["merged"],
            "excluded_uploads": log.to_json()["excluded"],
        }
        if merged is None:
            record = {
                "event": "dropped",
                "t": self.wall_of(now),
                "fragment": fragment,
                "version": admitted,
                "excluded": closing.excluded,
                **uploads,
            }
            params = model.params[fragment]
            state = self._momentum(fragment)
            total = self.merged_tokens[fragment]
            inputs = RoundInputs(fragment, log, total, changed=False)
            return Commit(
                fragment,
                admitted,
                params,
                state,
                record,
                log,
                history,
                total,
                changed=False,
                inputs=inputs,
            )
        self.last_commit_at[fragment] = now
        self.merged_tokens[fragment] += log.tokens
        param_norm = model.norm(fragment)  # ‖Θ_p‖ the round's norms were judged by
        outer_lr = scheduled_outer_lr(
            admitted,
            lr=self.config.outer_lr,
            decay_versions=self.config.outer_lr_decay,
            final=self.config.outer_lr_final,
        )
        version = model.step(fragment, merged, outer_lr)
        self.roster.note_commit(fragment, version, now)
        record = {
            "event": "round",
            "t": self.wall_of(now),
            "fragment": fragment,
            "version": version,
            "participants": [c.learner_id for c in contribs],
            "weights": [round(w, 6) for w in closing.weights],
            "staleness": [version - 1 - c.base_version for c in contribs],
            "steps": [c.steps for c in contribs],
            "norms": [round(c.norm, 6) for c in contribs],
            "param_norm": round(param_norm, 6),
            "tokens": sum(c.tokens for c in contribs),
            "tokens_by_learner": {c.learner_id: c.tokens for c in contribs},
            "bytes_up": sum(c.nbytes for c in contribs),
            "opened_at": None if round_.opened_at is None else self.wall_of(round_.opened_at),
            "wait_s": round(now - (round_.opened_at or now), 6),
            "asked": len(round_.asked) if round_.asked is not None else None,
            "increments": [c.increments for c in contribs],
            "reason": closing.reason,
            "share": round(closing.share, 6),
            "outer_lr": round(outer_lr, 6),
            "excluded": closing.excluded,
            "cosines": closing.cosines,
            "delta_norm": float(merged.norm()),
            **uploads,
        }
        inputs = RoundInputs(
            fragment,
            log,
            self.merged_tokens[fragment],
            contributions=[c.as_arrived() for c in contribs],
            weights=list(closing.weights),
            share=closing.share,
            outer_lr=outer_lr,
            outer_momentum=model.outer.momentum,
            mean_pieces=sorted(
                {
                    piece.name
                    for piece in closing.piece_layout.pieces
                    if closing.is_embedding(piece.name)
                }
            ),
            down_codec=self.config.down_codec,
            down_feedback=self.config.down_feedback,
        )
        return Commit(
            fragment,
            version,
            model.params[fragment],
            self._momentum(fragment),
            record,
            log,
            history,
            self.merged_tokens[fragment],
            inputs=inputs,
        )

    def _momentum(self, fragment: int) -> dict[str, torch.Tensor]:
        """The fragment's momentum as a commit carries it: the buffer itself, not a copy
        (``Commit``: the committer is its only writer)."""
        buffer = self.model.outer.buffer(fragment)
        return {} if buffer is None else {"momentum": buffer}

    def tokens_merged(self) -> int:
        """The tokens the run has merged into the global model: the mean over the owned
        fragments of ``merged_tokens`` (a learner's step trains every fragment and its tokens
        reach each fragment's round once, so one fragment's total counts the fleet's merged
        training). Tokens of contributions the direction check left out are not counted;
        those learners' heartbeats never are."""
        return sum(self.merged_tokens.values()) // max(len(self.merged_tokens), 1)

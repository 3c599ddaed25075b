"""How many uploads one learner may add to one round, and what a round's commit persists.

A learner's uploads to one fragment's open round are summed into one contribution, and every
one of them is named (id, steps, tokens) in the commit log persisted with every commit of the
fragment (its last ``PERSISTED_COMMITS``) and in the round's tape record. Zero-norm deltas
pass every size check, so without a cap one learner could make every later commit of a
fragment rewrite thousands of parts under the syncer's lock.
"""

from __future__ import annotations

import json

import torch
from kit import join_state, syncer_state, tiny_model

from diloco.syncer.config import SyncerConfig
from diloco.syncer.receipts import (
    PERSISTED_COMMITS,
    UPLOADS_PER_ROUND,
    CommitLog,
    Receipts,
    UploadPart,
)
from diloco.syncer.state import Refused
from diloco.syncer.store import FragmentStore

FLOOD = 1500
"""Zero-norm uploads the flooding learner sends to each round (issue 46)."""


def submit_zero(state, learner, session, upload_id, now, *, fragment=0, steps=1):
    numel = state.layout.fragments[fragment].numel
    return state.submit(
        learner,
        session,
        fragment=fragment,
        base_version=state.versions[fragment],
        steps=steps,
        tokens=8 * steps,
        delta=torch.zeros(numel),
        step_time_s=0.01,
        nbytes=numel,
        now=now,
        upload_id=upload_id,
    )


def flood_round(state, session, first_id: int, now: float) -> tuple[int, list[str]]:
    """``FLOOD`` zero-norm uploads of learner "flood" into fragment 0's open round: how many
    were accepted, and the codes of those refused."""
    accepted, codes = 0, []
    for i in range(FLOOD):
        try:
            accepted += submit_zero(state, "flood", session, first_id + i, now).accept
        except Refused as err:
            codes.append(err.code)
    return accepted, codes


def test_a_learner_that_floods_a_round_with_zero_deltas_is_capped_and_commits_stay_small(
    tmp_path,
):
    """Found by review (issue 46): 1,500 zero-norm uploads per round were all admitted; each
    went into the round record and every persisted commit log (an 864-byte fragment's file
    grew to 1.25 MB), and each commit rewrote O(64 x uploads) parts under the lock."""
    config = SyncerConfig(schedule="learner")
    state, layout, _ = syncer_state(tiny_model(0, (4, 8, 2)), config, num_fragments=2)
    flood = join_state(state, "flood", 0.0)
    honest = join_state(state, "honest", 0.0)
    store = FragmentStore(tmp_path)
    store.initialize(layout, {})
    param_bytes = 4 * layout.fragments[0].numel
    rounds = 3
    sizes = []
    for r in range(rounds):
        now = 1.0 + r
        accepted, codes = flood_round(state, flood, first_id=10_000 * (r + 1), now=now)
        assert accepted == UPLOADS_PER_ROUND, accepted
        assert set(codes) == {"FAILED_PRECONDITION"} and len(codes) == FLOOD - accepted
        # the cap is per learner: another learner's upload still enters the round
        assert submit_zero(state, "honest", honest, 7 + r, now).accept
        commits, _ = state.poll(now)
        (commit,) = commits
        assert commit.record["increments"] == [UPLOADS_PER_ROUND, 1]
        parts = sum(len(v) for log in commit.history for v in log["merged"].values())
        assert parts == (r + 1) * (UPLOADS_PER_ROUND + 1)  # not (r + 1) x FLOOD
        assert len(json.dumps(commit.record)) < 4096
        store.save(0, commit.version, commit.params, commit.momentum, commits=commit.history)
        sizes.append(store.path(0).stat().st_size)
    # the fragment's file: its tensors, a header and a few dozen bytes per admitted upload
    assert sizes[-1] < 2 * param_bytes + 2048 + 64 * rounds * (UPLOADS_PER_ROUND + 1), sizes


def test_resends_of_accepted_uploads_are_still_answered_once_the_cap_is_reached():
    """The cap counts admitted uploads, not resends: a resend of an accepted upload (its reply
    was lost) is answered with the version it was admitted at, before and after the commit,
    so exactly-once never meets the cap."""
    config = SyncerConfig(schedule="learner")
    state, _, _ = syncer_state(tiny_model(0, (4, 8, 2)), config, num_fragments=2)
    session = join_state(state, "a", 0.0)
    for upload_id in range(1, UPLOADS_PER_ROUND + 1):
        assert submit_zero(state, "a", session, upload_id, 1.0).accept
    for upload_id in range(1, UPLOADS_PER_ROUND + 1):
        again = submit_zero(state, "a", session, upload_id, 1.1)
        assert again.accept and again.version == 0 and again.reason == "already accepted"
    try:
        submit_zero(state, "a", session, 99, 1.2)
        raise AssertionError("an upload over the cap was admitted")
    except Refused as err:
        assert err.code == "FAILED_PRECONDITION" and "send it again" in err.message
    assert state.receipts.admitted("a", 99, fragment=0) is None  # refused: not remembered
    (commit,) = state.poll(1.3)[0]
    assert [u[0] for u in commit.record["uploads"]["a"]] == list(range(1, UPLOADS_PER_ROUND + 1))
    # after the commit the round is new: the refused progress goes in with the next upload
    assert submit_zero(state, "a", session, 100, 1.4).accept
    assert submit_zero(state, "a", session, 1, 1.5).reason == "already accepted"


def test_the_receipts_remember_every_upload_the_kept_logs_and_the_open_round_hold():
    """With at most ``UPLOADS_PER_ROUND`` uploads per learner per round, every id of the
    kept commit logs (here the fragment files' ``PERSISTED_COMMITS``) and of the open round
    is remembered: none is forgotten while its log is kept."""
    logs = [
        CommitLog(0, v + 1, v, {"a": [UploadPart(10 * v + i + 1, 1, 8) for i in range(4)]})
        for v in range(PERSISTED_COMMITS)
    ]
    receipts = Receipts()
    receipts.restore(logs)
    for i in range(UPLOADS_PER_ROUND):  # the open round
        receipts.admit("a", 10_000 + i, 0, PERSISTED_COMMITS)
    held = set(receipts.held("a"))
    assert len(held) == (PERSISTED_COMMITS + 1) * UPLOADS_PER_ROUND
    assert all(
        receipts.admitted("a", u.upload_id, 0) is not None for c in logs for u in c.merged["a"]
    )

"""The learner's ledger and how arrived fragments are applied (no syncer: fragments and the
link's answers are handed to the learner as its link would hand them).

Contract (docs/algorithm.md, "Learner side"): the undelivered progress ``u = (G − Σ ledger)
− θ`` is what the next delta carries; a delta leaves the ledger when the version that merges
it is applied (accepted, admitted before that version) or when it was not accepted (its
progress is undelivered again); a new global value keeps ``u`` and what is on its way.
"""

import pytest
import torch

import diloco
from diloco.learner.link import UploadResult


def make_learner(**overrides):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3, bias=False)
    # No syncer listens on port 1: the link just retries in the background.
    learner = diloco.Learner(
        model, syncer="127.0.0.1:1", num_fragments=1, learner_id="me", **overrides
    )
    return model, learner


@pytest.fixture
def made():
    """``make_learner()``'s model and learner, closed after the test."""
    model, learner = make_learner()
    yield model, learner
    learner.close(flush=False)


def weight(model):
    return model.weight.detach().reshape(-1).clone()


def train(model, learner, by: float, steps: int = 2, tokens: int = 10):
    """Emulate ``steps`` inner steps that move every weight by ``by`` in all."""
    with torch.no_grad():
        model.weight.add_(by)
    learner.steps_since[0] += steps
    learner.tokens_since[0] += steps * tokens


def queued_job(learner):
    """The delta the learner queued, taken back from its (never connected) link."""
    job = learner.link.withdraw(0)
    assert job is not None
    return job


def start(model, learner, v0):
    learner.listener.on_fragment(0, 1, v0, frozenset())
    learner.apply_arrived()
    assert torch.equal(weight(model), v0) and learner.versions[0] == 1


def test_a_foreign_merge_keeps_the_undelivered_progress_and_its_counters(made):
    model, learner = made
    v0 = torch.arange(12.0)
    start(model, learner, v0)
    train(model, learner, 0.5)
    learner.listener.on_fragment(0, 2, v0 + 2, frozenset({"other"}))
    learner.apply_arrived()
    assert torch.allclose(weight(model), v0 + 2.5)
    assert (learner.steps_since[0], learner.tokens_since[0]) == (2, 20)
    assert learner._queue(0)
    job = queued_job(learner)
    assert torch.allclose(job.delta, torch.full((12,), -0.5))  # only our progress
    assert (job.steps, job.tokens, job.base_version) == (2, 20, 2)


def test_every_step_is_sent_once_across_acceptance_and_merge(made):
    model, learner = made
    v0 = torch.arange(12.0)
    start(model, learner, v0)
    train(model, learner, 0.5, steps=4)
    assert learner._queue(0)
    job = queued_job(learner)
    assert learner.steps_since[0] == 0 and learner.in_flight() == {0: 1}
    train(model, learner, -0.25, steps=2)  # trained while the delta is on its way
    # A version arrives before the upload's answer: it waits (it may hold our delta).
    learner.listener.on_fragment(0, 2, v0 + 1, frozenset({"me"}))
    assert learner.apply_arrived() == 0 and learner.versions[0] == 1
    sent = job.delta.clone()
    learner.listener.on_result(job, UploadResult("accepted", admitted=1, sent=sent))
    learner.apply_arrived()  # version 2 merged our delta (admitted at 1)
    assert learner.versions[0] == 2 and learner.in_flight() == {}
    assert torch.allclose(weight(model), v0 + 1 - 0.25)  # what came after the delta
    assert learner.steps_since[0] == 2  # ... and only its steps are still to send
    assert learner._queue(0)
    assert torch.allclose(queued_job(learner).delta, torch.full((12,), 0.25))


def test_an_accepted_delta_stays_on_its_way_through_a_version_that_does_not_merge_it(made):
    model, learner = made
    v0 = torch.zeros(12)
    start(model, learner, v0)
    train(model, learner, 1.0)
    learner._queue(0)
    job = queued_job(learner)
    learner.listener.on_result(job, UploadResult("accepted", admitted=2, sent=job.delta.clone()))
    learner.listener.on_fragment(0, 2, v0 + 3, frozenset({"other"}))  # committed before ours
    learner.apply_arrived()
    assert learner.in_flight() == {0: 1}
    assert torch.allclose(weight(model), v0 + 3 + 1)  # our delta is still pending
    assert not learner._queue(0)  # nothing new to send: no step since
    learner.listener.on_fragment(0, 3, torch.full((12,), 2.0), frozenset({"me", "other"}), 2)
    learner.apply_arrived()
    assert learner.in_flight() == {} and torch.equal(weight(model), v0 + 5)


def test_a_failed_or_refused_upload_returns_its_progress_and_nothing_is_counted_twice():
    for outcome in ("failed", "stale", "refused"):
        model, learner = make_learner()
        try:
            start(model, learner, torch.zeros(12))
            train(model, learner, 1.0, steps=3)
            learner._queue(0)
            job = queued_job(learner)
            train(model, learner, 1.0, steps=1)
            learner.listener.on_result(job, UploadResult(outcome))
            learner.apply_arrived()
            assert learner.in_flight() == {} and learner.steps_since[0] == 4, outcome
            learner._queue(0)
            again = queued_job(learner)
            assert (again.steps, again.tokens) == (4, 40)
            assert torch.allclose(again.delta, torch.full((12,), -2.0))
        finally:
            learner.close(flush=False)


def test_a_delta_still_queued_is_withdrawn_and_sent_with_the_newer_progress(made):
    model, learner = made
    start(model, learner, torch.zeros(12))
    train(model, learner, 1.0, steps=3)
    learner._queue(0)
    train(model, learner, 0.5, steps=1)
    learner._queue(0)  # the first is still queued: withdrawn, both go out as one
    job = queued_job(learner)
    assert (job.steps, job.tokens) == (4, 40) and learner.counters["withdrawn"] == 1
    assert torch.allclose(job.delta, torch.full((12,), -1.5))
    assert learner.in_flight() == {0: 1}


def test_a_learner_says_how_many_global_versions_it_applied(made, caplog, monkeypatch):
    """Issue 36, friction 7: a progress line every ``LOG_EVERY_MERGES`` versions applied."""
    import logging

    import diloco.learner.learner as learner_module

    model, learner = made
    monkeypatch.setattr(learner_module, "LOG_EVERY_MERGES", 2)
    caplog.set_level(logging.INFO, logger="diloco.learner")
    for version in (1, 2, 3):
        learner.listener.on_fragment(0, version, torch.full((12,), float(version)), frozenset())
        learner.apply_arrived()
    said = [r.getMessage() for r in caplog.records if "global versions applied" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("learner me: 2 global versions applied (step 0")


def test_the_residual_of_the_quantized_upload_goes_out_next_time(made):
    model, learner = made
    start(model, learner, torch.zeros(12))
    train(model, learner, 1.0)
    learner._queue(0)
    job = queued_job(learner)
    sent = job.delta * 0.9  # the syncer decoded less than was queued
    learner.listener.on_result(job, UploadResult("accepted", admitted=1, sent=sent))
    learner.apply_arrived()
    train(model, learner, 0.0, steps=1)
    learner._queue(0)
    assert torch.allclose(queued_job(learner).delta, job.delta * 0.1)


def test_deltas_apply_bit_exactly_and_one_that_does_not_fit_asks_for_a_keyframe(made):
    model, learner = made
    v0 = torch.randn(12)
    start(model, learner, v0)
    d1, d2 = torch.randn(12), torch.randn(12)
    learner.listener.on_fragment(0, 2, d1, frozenset(), 1)
    learner.listener.on_fragment(0, 3, d2, frozenset(), 2)
    learner.apply_arrived()
    assert learner.versions[0] == 3 and torch.equal(weight(model), (v0 + d1) + d2)
    learner.listener.on_fragment(0, 9, d1, frozenset(), 7)  # starts from a version we lack
    learner.apply_arrived()
    assert learner.versions[0] == 3 and learner.counters["resyncs"] == 1
    assert learner.listener.have_versions() == [-1]  # the next subscription asks for a keyframe
    learner.listener.on_fragment(0, 9, v0, frozenset())
    learner.apply_arrived()
    assert learner.versions[0] == 9 and learner.listener.have_versions() == [9]


def test_own_merge_overwrites_when_rebase_own_is_off():
    model, learner = make_learner(rebase_own=False)
    try:
        start(model, learner, torch.zeros(12))
        train(model, learner, 1.0)
        learner._queue(0)
        job = queued_job(learner)
        learner.listener.on_result(
            job, UploadResult("accepted", admitted=1, sent=job.delta.clone())
        )
        train(model, learner, 0.5)
        learner.listener.on_fragment(0, 2, torch.full((12,), 2.0), frozenset({"me"}))
        learner.apply_arrived()
        assert torch.equal(weight(model), torch.full((12,), 2.0))  # the paper's overwrite
        assert learner.steps_since[0] == 0
    finally:
        learner.close(flush=False)


def test_a_guard_refusal_drops_the_undelivered_progress_once(made):
    model, learner = made
    start(model, learner, torch.zeros(12))
    train(model, learner, 50.0)
    learner._queue(0)
    job = queued_job(learner)
    learner.listener.on_result(job, UploadResult("guard"))
    learner.apply_arrived()
    assert torch.equal(weight(model), torch.zeros(12)) and learner.guard_resets == 1
    assert learner.steps_since[0] == 0 and learner.last_applied == [0]


def test_the_ledger_survives_a_checkpoint():
    model, learner = make_learner()
    try:
        start(model, learner, torch.zeros(12))
        train(model, learner, 1.0)
        learner._queue(0)
        job = queued_job(learner)
        learner.listener.on_result(
            job, UploadResult("accepted", admitted=1, sent=job.delta.clone())
        )
        state = learner.state_dict()
    finally:
        learner.close(flush=False)
    restored = diloco.Learner(
        model, syncer="127.0.0.1:1", num_fragments=1, learner_id="me", state=state
    )
    try:
        assert restored.in_flight() == {0: 1}
        restored.listener.on_fragment(0, 2, torch.full((12,), 1.0), frozenset({"me"}))
        restored.apply_arrived()  # the version that merged it: nothing left on its way
        assert restored.in_flight() == {} and torch.equal(weight(model), torch.full((12,), 1.0))
    finally:
        restored.close(flush=False)


def test_a_claim_is_dropped_by_any_arrival_of_its_fragment():
    """A learner claims the values it holds at join; a keyframe instead of "you hold it"
    must not leave the claimed copy behind (it was kept for good: a model's worth of memory)."""
    import torch

    from diloco.learner.inbox import Inbox

    inbox = Inbox()
    inbox.claim(0, torch.ones(4))
    inbox.claim(1, torch.ones(4))
    assert inbox.arrive(0, 0, -1, None, ())  # "you hold it": the claim is the value
    assert inbox.arrive(1, 3, -1, torch.zeros(4), ())  # a keyframe: the claim is moot
    assert inbox._claims == {}
    assert not inbox.arrive(2, 0, -1, None, ())  # nothing claimed: a keyframe is needed
    assert inbox.needs_keyframe(2)


class HeldEvent:
    """A copy's completion event that reports "landed" only once released."""

    def __init__(self) -> None:
        self.landed = False

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        self.landed = True


def test_a_copy_that_lands_later_makes_the_delta_as_of_when_it_was_taken():
    """As on a CUDA device (diloco.learner.snapshot): the delta is made when θ's copy to the
    host lands, from θ, G and the deltas on their way as they were when it was taken; an
    arrival of that fragment waits for it, and the progress trained meanwhile goes out next."""
    from diloco.learner.snapshot import HostCopy

    model, learner = make_learner()
    try:
        v0 = torch.arange(12.0)
        start(model, learner, v0)
        event = HeldEvent()
        learner._host_copies.take = lambda p: HostCopy(
            learner.layout.gather(p, learner.params), event
        )
        train(model, learner, 0.5, steps=2)
        assert learner._queue(0)
        assert learner.link.withdraw(0) is None and 0 in learner._copying  # not made yet
        assert learner.unsent() == [2]
        assert not learner._queue(0)  # one copy at a time: the progress waits
        train(model, learner, -0.25, steps=3)  # trained while the copy is on its way
        learner.listener.on_fragment(0, 2, v0 + 2, frozenset({"other"}))
        learner.apply_arrived()
        assert learner.versions[0] == 1  # the arrival waits for the delta to be made
        learner._send_copied()
        assert 0 in learner._copying  # not landed: nothing sent, nothing waited for
        event.landed = True
        learner._send_copied()
        job = queued_job(learner)
        assert torch.allclose(job.delta, torch.full((12,), -0.5))  # θ as of the copy
        assert (job.steps, job.tokens, job.base_version) == (2, 20, 1)
        learner.listener.on_result(job, UploadResult("failed"))  # back to the undelivered progress
        learner.apply_arrived()  # now the foreign version applies, keeping all our progress
        assert learner.versions[0] == 2
        assert torch.allclose(weight(model), v0 + 2.25)
        assert learner.steps_since[0] == 5 and learner.unsent() == [5]
        event.landed = False
        assert learner._queue(0)
        event.landed = True
        learner._send_copied()
        job = queued_job(learner)
        assert torch.allclose(job.delta, torch.full((12,), -0.25))  # both trainings, once
        assert (job.steps, job.tokens, job.base_version) == (5, 50, 2)
    finally:
        learner.close(flush=False)


def test_an_answer_is_settled_before_a_rejoin_reported_after_it(made):
    """Issue 32, defect 3: the learner settled every queued rejoin before the upload answers
    that had arrived earlier. An "accepted" answer from a syncer that then died with the
    round open was applied after the rejoin to its restarted successor, so the delta stayed
    on the ledger waiting for a merge that would never hold it (its steps lost). Answers,
    rejoins and notes are settled in the order they arrived."""
    model, learner = made
    v0 = torch.arange(12.0)
    learner.listener.on_rejoin("127.0.0.1:1", "first-syncer", [0], (0,))
    start(model, learner, v0)
    train(model, learner, 0.5, steps=4)
    assert learner._queue(0)
    job = queued_job(learner)
    # accepted at version 1; then the syncer died before committing that round
    learner.listener.on_result(job, UploadResult("accepted", admitted=1, sent=job.delta.clone()))
    # restored version 1; its logs, complete from version 0, do not hold the delta
    learner.listener.on_rejoin("127.0.0.1:1", "its-successor", [1], (0,), [], [0])
    learner.apply_arrived()
    assert learner.in_flight() == {}
    assert learner.steps_since[0] == 4  # undelivered again: it goes out with the next
    assert learner.accounting().unsent == (4,)


def undelivered(model, learner):
    """``u = (G − Σ ledger) − θ`` of fragment 0."""
    on_its_way = learner._ledger.on_its_way(0)
    held = learner.anchors[0] - (on_its_way if on_its_way is not None else 0)
    return held - weight(model)


def test_the_quantization_residual_survives_a_merge_applied_in_the_same_step(made):
    """Accepted, the ledger keeps what the syncer decoded: the residual ``delta − sent`` is
    undelivered progress although no step was trained since (``steps_since`` 0). A version
    applied right after (same step) must keep it, not overwrite it (error feedback)."""
    model, learner = made
    start(model, learner, torch.zeros(12))
    train(model, learner, 1.0)
    learner._queue(0)
    job = queued_job(learner)
    sent = job.delta * 0.9  # the syncer decoded less than was queued
    learner.listener.on_result(job, UploadResult("accepted", admitted=1, sent=sent))
    learner.listener.on_fragment(0, 2, torch.full((12,), 3.0), frozenset({"me"}))
    learner.apply_arrived()  # settles the acceptance, then applies version 2
    assert learner.versions[0] == 2 and learner.steps_since[0] == 0
    assert torch.allclose(undelivered(model, learner), job.delta - sent)


def accepted_then_version_two(model, learner, *, note_first: bool):
    """Queue 4 steps of fragment 0, have them accepted at version 1, the syncer's note that
    it left them out of the merge (before or after version 2 is applied), and version 2."""
    v0 = torch.arange(12.0)
    start(model, learner, v0)
    train(model, learner, 0.5, steps=4)
    learner.local_step += 4  # (``train`` emulates the steps' counters only)
    assert learner._queue(0)
    job = queued_job(learner)
    assert job.upload_id  # named by the learner when queued
    learner.listener.on_result(job, UploadResult("accepted", admitted=1, sent=job.delta.clone()))
    if note_first:
        learner.listener.on_versions("127.0.0.1:1", [], [job.upload_id])
    learner.listener.on_fragment(0, 2, v0 + 1, frozenset({"other"}))
    learner.apply_arrived()
    if not note_first:
        learner.listener.on_versions("127.0.0.1:1", [2], [job.upload_id, 12345])  # 12345: not ours
    return learner.accounting()


def test_a_delta_the_syncer_left_out_is_counted_as_dropped_not_merged():
    """Issue 32, defect 18: a delta the direction check leaves out of its round's merge was
    neither merged nor counted as dropped by its learner (it took the next version as the
    one merging it), so no accounting could balance while the check was on. The syncer now
    names left-out upload ids (with the version's download and in heartbeat replies), and
    the learner counts their steps as excluded, whichever comes first."""
    for note_first in (True, False):
        model, learner = make_learner()
        try:
            books = accepted_then_version_two(model, learner, note_first=note_first)
            assert books.trained == 4
            assert (books.merged, books.excluded, books.in_flight) == ((0,), (4,), (0,))
            assert books.balanced()
            assert learner.counters["excluded"] == 1 and learner.counters["merged"] == 0
        finally:
            learner.close(flush=False)


def test_steps_before_the_first_arrival_are_dropped_by_it(made):
    """The first arrival of a fragment overwrites the learner's own initial values: the steps
    trained on them are thrown away (``dropped``), not sent as weight without a delta."""
    model, learner = made
    for _ in range(3):
        learner.step(tokens=10)  # nothing is sent: the fragment was never received
    learner.listener.on_fragment(0, 1, torch.arange(12.0), frozenset())
    learner.apply_arrived()
    assert (learner.steps_since[0], learner.tokens_since[0]) == (0, 0)
    assert learner.dropped[0] == 3
    assert learner.local_step == learner.unsent()[0] + learner.dropped[0]  # none merged


def test_a_guard_reset_drops_a_snapshot_whose_copy_is_still_on_its_way():
    """CUDA (diloco.learner.snapshot): a norm-guard reset while p's copy to the host is in
    flight. The reset throws away all progress beyond ``G − ledger``, the snapshot's too: its
    delta, made later from the pre-reset θ, would go out and the next delta would carry its
    reverse."""
    from diloco.learner.snapshot import HostCopy

    model, learner = make_learner()
    try:
        start(model, learner, torch.zeros(12))
        train(model, learner, 1.0, steps=2)
        learner._queue(0)
        refused = queued_job(learner)  # on the wire, no answer yet
        event = HeldEvent()
        learner._host_copies.take = lambda p: HostCopy(
            learner.layout.gather(p, learner.params), event
        )
        train(model, learner, 0.5, steps=2)
        assert learner._queue(0) and 0 in learner._copying
        learner.listener.on_result(refused, UploadResult("guard"))
        learner.apply_arrived()  # the reset: θ back to G
        assert torch.equal(weight(model), torch.zeros(12))
        event.landed = True
        learner._send_copied()
        jobs = []
        job = learner.link.withdraw(0)
        if job is not None:
            jobs.append(job)  # sent: the next delta is made against it
        train(model, learner, 0.25, steps=1)
        assert learner._queue(0)
        jobs.append(queued_job(learner))
        assert [(j.steps, j.delta.tolist()) for j in jobs] == [(1, [-0.25] * 12)]
        assert learner.dropped[0] == 4 and learner.unsent() == [1]  # 5 trained in all
    finally:
        learner.close(flush=False)


def test_versions_waiting_for_an_answer_are_held_as_a_bounded_exact_chain():
    """A delta of p on the wire and no answer (a slow link): every version of p that arrives
    waits. The waiting chain is coalesced exactly into one entry (bounded memory), and once
    applied the learner holds bit for bit the value the whole chain gives."""
    from diloco.learner.inbox import MAX_WAITING_CHAIN

    model, learner = make_learner()
    try:
        v0 = torch.randn(12)
        start(model, learner, v0)
        train(model, learner, 1.0)
        learner._queue(0)
        job = queued_job(learner)  # on the wire, no answer
        expected = v0
        gen = torch.Generator().manual_seed(1)
        for v in range(2, 52):
            d = torch.randn(12, generator=gen) * 1e-3
            expected = expected + d
            learner.listener.on_fragment(0, v, d, frozenset({f"l{v % 3}"}), v - 1)
            learner.step(tokens=10)
            assert learner.versions[0] == 1  # waits for the answer
            assert len(learner._inbox._arrived[0]) <= MAX_WAITING_CHAIN + 1
        learner.listener.on_result(
            job, UploadResult("accepted", admitted=1, sent=job.delta.clone())
        )
        learner.apply_arrived()
        assert learner.versions[0] == 51 and torch.equal(learner.anchors[0], expected)
        assert learner._ledger.find(0, job.job_id) is None  # merged back
    finally:
        learner.close(flush=False)


def test_an_answer_reported_after_the_rejoin_to_a_restarted_syncer_is_judged_by_it(made):
    """Found by the torture run: the link's sender thread may report the "accepted" answer
    of a syncer that then died *after* the link thread reported the rejoin to its restarted
    successor (two threads). Settled in that order, the delta waited for a merge by a syncer
    that never held it, and its steps were counted as merged (55 to 73 steps of a fragment
    lost, twice in 30 runs). An answer names the syncer instance that gave it: one from an
    instance the learner already saw replaced is judged by its successor's kept commit
    logs, as the rejoin judges the answers settled before it."""
    model, learner = made
    v0 = torch.arange(12.0)
    learner.listener.on_rejoin("127.0.0.1:1", "first-syncer", [0], (0,))
    start(model, learner, v0)
    train(model, learner, 0.5, steps=4)
    assert learner._queue(0)
    job = queued_job(learner)
    learner.listener.on_rejoin("127.0.0.1:1", "its-successor", [1], (0,), [], [0])
    accepted = UploadResult(
        "accepted", admitted=1, sent=job.delta.clone(), syncer_id="first-syncer"
    )
    learner.listener.on_result(job, accepted)  # reported late, by the other thread
    learner.apply_arrived()
    assert learner.in_flight() == {} and learner.steps_since[0] == 4  # sent again
    # the same late answer with an admission the successor's disk holds was merged
    train(model, learner, 0.5, steps=2)
    assert learner._queue(0)
    job = queued_job(learner)
    # restored version 3, whose kept logs hold the delta's upload id
    learner.listener.on_rejoin("127.0.0.1:1", "third-syncer", [3], (0,), [job.upload_id], [0])
    merged_before = UploadResult(
        "accepted", admitted=1, sent=job.delta.clone(), syncer_id="its-successor"
    )
    learner.listener.on_result(job, merged_before)
    learner.apply_arrived()
    assert learner.in_flight() == {0: 1} and learner.steps_since[0] == 0


def test_a_rejoin_past_a_syncer_it_never_saw_returns_what_that_syncer_did_not_commit(made):
    """Found by the torture run: accepted at version 2 by a syncer that died with the round
    open; a second syncer (this learner never reached it) committed version 3 of the
    fragment without the delta and died too; the third restored version 3. Judged by
    versions (2 < 3), the delta looked merged and its steps were lost. The restarted
    syncer now lists the learner's upload ids its commit logs hold: the delta is not among
    them, so it goes out again; one that is listed stays, to be merged by its version."""
    model, learner = made
    learner.listener.on_rejoin("127.0.0.1:1", "first", [0], (0,))
    start(model, learner, torch.arange(12.0))
    kept, lost = [], []
    for admitted, out in ((2, lost), (1, kept)):
        train(model, learner, 0.5, steps=3)
        assert learner._queue(0)
        job = queued_job(learner)
        learner.listener.on_result(job, UploadResult("accepted", admitted=admitted, sent=job.delta))
        out.append(job.upload_id)
    learner.apply_arrived()
    learner.listener.on_rejoin("127.0.0.1:1", "third", [3], (0,), kept, [0])
    learner.apply_arrived()
    on_the_ledger = {e.upload_id for _, e in learner._ledger.items()}
    assert on_the_ledger == set(kept)
    assert learner.steps_since[0] == 3  # the lost delta's steps go out again


def test_a_delta_admitted_before_every_log_the_syncer_kept_is_unknown_never_guessed(made):
    """Issue 46, defect 1: a delta accepted at version 1, whose merge never came back (a
    partition), judged at a rejoin to a syncer whose logs are complete only from version 2:
    today's code took it as merged because a restored version (3) is past its admission, so
    steps no commit may have merged were counted merged. Its fate is unknown: it leaves the
    ledger, is not sent again, and its steps are counted in the ``unknown`` column."""
    model, learner = made
    learner.listener.on_rejoin("127.0.0.1:1", "first", [0], (0,))
    start(model, learner, torch.arange(12.0))
    train(model, learner, 0.5, steps=3)
    assert learner._queue(0)
    job = queued_job(learner)
    learner.listener.on_result(job, UploadResult("accepted", admitted=1, sent=job.delta))
    learner.apply_arrived()
    learner.listener.on_rejoin("127.0.0.1:1", "restarted", [3], (0,), [], [2])
    learner.apply_arrived()
    books = learner.accounting()
    assert learner.in_flight() == {} and learner.steps_since[0] == 0  # not sent again
    assert books.unknown == (3,) and books.merged == (0,)
    assert learner.counters["unknown"] == 1


def test_a_resend_answered_fate_unknown_is_neither_merged_nor_sent_again(made):
    """A resend the syncer answers ``fate_unknown`` (``UploadResult("unknown")``): counted
    unknown, off the ledger, its progress not returned."""
    model, learner = made
    learner.listener.on_rejoin("127.0.0.1:1", "first", [0], (0,))
    start(model, learner, torch.arange(12.0))
    train(model, learner, 0.5, steps=2)
    assert learner._queue(0)
    job = queued_job(learner)
    learner.listener.on_result(job, UploadResult("unknown"))
    learner.apply_arrived()
    books = learner.accounting()
    assert books.unknown == (2,) and books.unsent == (0,)


def test_a_delta_accepted_by_the_syncer_it_rejoins_is_not_returned(made):
    """Found by review: the link published the new instance's session before it reported
    the rejoin, so an answer of that very instance could be settled before the rejoin to it
    and judged as a dead syncer's (returned, then merged twice). Answers name their
    instance; a rejoin leaves what its own instance accepted alone."""
    model, learner = made
    learner.listener.on_rejoin("127.0.0.1:1", "old", [0], (0,))
    start(model, learner, torch.arange(12.0))
    train(model, learner, 0.5, steps=3)
    assert learner._queue(0)
    job = queued_job(learner)
    answer = UploadResult("accepted", admitted=1, sent=job.delta, syncer_id="new")
    learner.listener.on_result(job, answer)
    learner.apply_arrived()
    learner.listener.on_rejoin("127.0.0.1:1", "new", [1], (0,), [], [0])
    learner.apply_arrived()
    assert learner.in_flight() == {0: 1} and learner.steps_since[0] == 0


def test_a_restored_delta_without_an_answer_is_sent_again_as_it_was():
    """Found by review: a learner restored (without a delivery log) from a checkpoint taken
    while an upload waited for its answer kept that delta on its ledger with no upload to
    answer it: arrivals of the fragment waited for it forever. It is resumed: sent again
    with its upload id, so the syncer answers it with its first verdict if it had it."""
    model, learner = make_learner()
    try:
        start(model, learner, torch.arange(12.0))
        train(model, learner, 0.5, steps=3)
        assert learner._queue(0)  # sent, no answer yet
        saved = learner.state_dict()
        upload_id = learner.link.queue._jobs[0].upload_id
    finally:
        learner.close(flush=False)
    model2 = torch.nn.Linear(4, 3, bias=False)
    restored = diloco.Learner(
        model2, syncer="127.0.0.1:1", num_fragments=1, learner_id="me", state=saved
    )
    try:
        (resumed,) = restored.link.queue._resends
        assert resumed.upload_id == upload_id and resumed.steps == 3
        assert [e.upload_id for _, e in restored._ledger.items()] == [upload_id]
        # a resend (``UploadChunk.resend``): the earlier life may have had it accepted, so a
        # syncer that no longer keeps its commit's log answers fate_unknown, never "stale"
        # (found by the torture run: refused stale, its progress was sent and merged twice)
        assert resumed.attempts >= 1
    finally:
        restored.close(flush=False)


def test_an_upload_given_up_after_it_went_on_the_wire_is_unknown_not_folded():
    """Found by review (issue 46): an upload unanswered 21 times, or displaced by 64 newer
    unanswered ones, was answered "failed", so its progress went out again in a new upload:
    merged twice if the syncer had accepted it and only its replies were lost. Once it has
    been on the wire its fate is unknown; one that never left is still "failed"."""
    import threading

    from diloco.learner.uploads import UploadJob, UploadQueue

    running, stopping = threading.Event(), threading.Event()
    stopping.set()
    job = UploadJob(0, 0, 3, 30, torch.zeros(4), 0.0, upload_id=7)
    assert UploadQueue.given_up(job, running).outcome == "failed"  # never left
    job.on_the_wire = True
    assert UploadQueue.given_up(job, running).outcome == "unknown"
    assert UploadQueue.given_up(job, stopping).outcome == "failed"  # (the close report)

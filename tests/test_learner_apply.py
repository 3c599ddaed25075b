"""How arrived fragments are applied: rebase (keep the local progress) when the merge holds
only other learners' work, keep what came after our delta when it holds ours, overwrite when
both rebases are off."""

import torch

import diloco


def make_learner(**overrides):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3, bias=False)
    # No syncer listens on port 1: the link just retries in the background; nothing here
    # needs the network, fragments are handed to the learner as its link would.
    learner = diloco.Learner(
        model, syncer="127.0.0.1:1", fragments=1, sync_every=4, learner_id="me", **overrides
    )
    return model, learner


def weight(model):
    return model.weight.detach().reshape(-1).clone()


def test_foreign_merge_is_rebased_and_in_flight_progress_is_not_sent_twice():
    model, learner = make_learner()
    try:
        v0 = torch.arange(12.0)
        learner._on_fragment(0, 1, v0, frozenset())
        learner.apply_arrived()
        assert torch.equal(weight(model), v0)
        d1 = torch.full((12,), 0.5)
        with torch.no_grad():
            model.weight.add_(d1.reshape(3, 4))
        learner.steps_since[0], learner.tokens_since[0] = 4, 40
        learner._queue(0)  # delta −d1 goes out against version 1
        g = torch.full((12,), 2.0)
        learner._on_fragment(0, 2, v0 + g, frozenset({"other"}))
        learner.apply_arrived()
        assert torch.allclose(weight(model), v0 + g + d1)  # our progress survived
        assert learner.versions[0] == 2
        assert torch.allclose(learner.anchors[0] - weight(model), torch.zeros(12))
        assert (learner.steps_since[0], learner.tokens_since[0]) == (0, 0)
        d2 = torch.full((12,), -0.25)
        with torch.no_grad():
            model.weight.add_(d2.reshape(3, 4))
        assert torch.allclose(learner.anchors[0] - weight(model), -d2)  # only the new progress
        learner.steps_since[0], learner.tokens_since[0] = 2, 20
        # The merge that holds our delta arrives: what came after it (d2) is kept.
        learner._on_fragment(0, 3, v0 + 7, frozenset({"me", "other"}))
        learner.apply_arrived()
        assert torch.allclose(weight(model), v0 + 7 + d2)
        assert torch.equal(learner.anchors[0], v0 + 7)
        assert (learner.steps_since[0], learner.tokens_since[0]) == (2, 20)
        assert learner.versions[0] == 3 and 0 not in learner._sent
    finally:
        learner.close(flush=False)


def test_foreign_merge_without_anything_in_flight_keeps_counters():
    model, learner = make_learner()
    try:
        learner._on_fragment(0, 1, torch.zeros(12), frozenset())
        learner.apply_arrived()
        with torch.no_grad():
            model.weight.add_(1.0)
        learner.steps_since[0], learner.tokens_since[0] = 3, 30
        learner._on_fragment(0, 2, torch.full((12,), 5.0), frozenset({"other"}))
        learner.apply_arrived()
        assert torch.allclose(weight(model), torch.full((12,), 6.0))
        assert (learner.steps_since[0], learner.tokens_since[0]) == (3, 30)
        assert torch.allclose(learner.anchors[0] - weight(model), torch.full((12,), -1.0))
    finally:
        learner.close(flush=False)


def test_overwrite_everything_when_rebase_is_off():
    model, learner = make_learner(rebase_foreign=False)
    try:
        learner._on_fragment(0, 1, torch.zeros(12), frozenset())
        learner.apply_arrived()
        with torch.no_grad():
            model.weight.add_(1.0)
        learner._on_fragment(0, 2, torch.full((12,), 5.0), frozenset({"other"}))
        learner.apply_arrived()
        assert torch.equal(weight(model), torch.full((12,), 5.0))
        assert learner.steps_since[0] == 0
    finally:
        learner.close(flush=False)


def test_skipped_versions_keep_their_contributors():
    _, learner = make_learner()
    try:
        learner._on_fragment(0, 1, torch.zeros(12), frozenset({"me"}))
        learner._on_fragment(0, 2, torch.ones(12), frozenset({"other"}))
        assert learner._arrived[0][2] == {"me", "other"}
    finally:
        learner.close(flush=False)


def test_a_learner_without_local_progress_takes_a_foreign_merge_bit_exactly():
    model, learner = make_learner()
    try:
        torch.manual_seed(1)
        first, second = torch.randn(12), torch.randn(12)
        learner._on_fragment(0, 1, first, frozenset({"me"}))
        learner.apply_arrived()
        learner._on_fragment(0, 2, second, frozenset({"other"}))
        learner.apply_arrived()
        # θ + (Θ − A) computed as Θ + (θ − A) is Θ itself, not Θ up to rounding.
        assert torch.equal(weight(model), second)
    finally:
        learner.close(flush=False)


def test_flush_does_not_send_a_fragment_again_whose_queued_delta_holds_all_its_progress():
    model, learner = make_learner()
    try:
        learner._on_fragment(0, 1, torch.zeros(12), frozenset())
        learner.apply_arrived()
        with torch.no_grad():
            model.weight.add_(1.0)
        learner.steps_since[0], learner.tokens_since[0] = 4, 40
        learner._queue(0)  # the last step's due upload
        queued = learner.link._jobs[0]
        assert not learner.flush(timeout=0)  # nothing can go out: no syncer
        assert learner.link._jobs[0] is queued  # not queued a second time
        assert learner._flushed == {0: 1}  # but the drain still waits for its merge
        # one more step of progress: the flush sends it (the newer delta replaces the queued)
        with torch.no_grad():
            model.weight.add_(1.0)
        learner.steps_since[0], learner.tokens_since[0] = 5, 50
        learner.flush(timeout=0)
        job = learner.link._jobs[0]
        assert job is not queued and (job.steps, job.tokens) == (5, 50)
        assert torch.allclose(job.delta, torch.full((12,), -2.0))
    finally:
        learner.close(flush=False)


def queue_then_train_on(model, learner, queued_steps=4, after_steps=2):
    """From Θ = 0 at version 1: train d1, queue it, then train d2 more (if ``after_steps``);
    returns (d1, d2)."""
    learner._on_fragment(0, 1, torch.zeros(12), frozenset())
    learner.apply_arrived()
    d1, d2 = torch.full((12,), 0.5), torch.full((12,), -0.25)
    with torch.no_grad():
        model.weight.add_(d1.reshape(3, 4))
    learner.steps_since[0], learner.tokens_since[0] = queued_steps, 10 * queued_steps
    learner._queue(0)
    if after_steps:
        with torch.no_grad():
            model.weight.add_(d2.reshape(3, 4))
    total = queued_steps + after_steps
    learner.steps_since[0], learner.tokens_since[0] = total, 10 * total
    return d1, d2


def test_own_merge_keeps_the_steps_trained_while_the_delta_was_in_flight():
    model, learner = make_learner()
    try:
        _, d2 = queue_then_train_on(model, learner)
        merged = torch.full((12,), 3.0)
        learner._on_fragment(0, 2, merged, frozenset({"me"}))
        learner.apply_arrived()
        assert torch.allclose(weight(model), merged + d2)
        assert torch.equal(learner.anchors[0], merged)
        assert (learner.steps_since[0], learner.tokens_since[0]) == (2, 20)
        assert 0 not in learner._sent
        # the next delta holds exactly what came after the merged one
        assert torch.allclose(learner.anchors[0] - weight(model), -d2)
    finally:
        learner.close(flush=False)


def test_own_merge_with_nothing_trained_after_the_delta_is_exactly_the_global_value():
    model, learner = make_learner()
    try:
        queue_then_train_on(model, learner, after_steps=0)
        merged = torch.randn(12)
        learner._on_fragment(0, 2, merged, frozenset({"me"}))
        learner.apply_arrived()
        assert torch.equal(weight(model), merged)
        assert (learner.steps_since[0], learner.tokens_since[0]) == (0, 0)
    finally:
        learner.close(flush=False)


def test_foreign_merges_then_own_merge_keep_every_step_exactly_once():
    model, learner = make_learner()
    try:
        d1, d2 = queue_then_train_on(model, learner)
        g1, g2 = torch.full((12,), 2.0), torch.full((12,), 5.0)
        learner._on_fragment(0, 2, g1, frozenset({"other"}))  # our delta still in flight
        learner.apply_arrived()
        learner._on_fragment(0, 3, g2, frozenset({"other"}))  # and still
        learner.apply_arrived()
        assert torch.allclose(weight(model), g2 + d1 + d2)  # all our progress on top
        assert torch.allclose(learner.anchors[0], g2 + d1)  # the next delta: d2 only
        assert (learner.steps_since[0], learner.tokens_since[0]) == (2, 20)
        merged = torch.full((12,), 9.0)  # the merge that holds d1
        learner._on_fragment(0, 4, merged, frozenset({"me", "other"}))
        learner.apply_arrived()
        assert torch.allclose(weight(model), merged + d2)
        assert torch.equal(learner.anchors[0], merged)
        assert (learner.steps_since[0], learner.tokens_since[0]) == (2, 20)
    finally:
        learner.close(flush=False)


def test_own_merge_overwrites_when_rebase_own_is_off():
    model, learner = make_learner(rebase_own=False)
    try:
        queue_then_train_on(model, learner)
        merged = torch.full((12,), 3.0)
        learner._on_fragment(0, 2, merged, frozenset({"me"}))
        learner.apply_arrived()
        assert torch.equal(weight(model), merged)
        assert (learner.steps_since[0], learner.tokens_since[0]) == (0, 0)
    finally:
        learner.close(flush=False)


def test_flush_sends_the_progress_after_a_rebased_in_flight_delta():
    model, learner = make_learner()
    try:
        queue_then_train_on(model, learner, queued_steps=4, after_steps=0)
        learner._on_fragment(0, 2, torch.full((12,), 2.0), frozenset({"other"}))
        learner.apply_arrived()  # counters now 0: the in-flight delta holds everything
        with torch.no_grad():
            model.weight.add_(1.0)
        learner.steps_since[0], learner.tokens_since[0] = 4, 40  # as many steps as the delta
        learner.flush(timeout=0)
        job = learner.link._jobs[0]
        assert (job.steps, job.tokens) == (4, 40)
        assert torch.allclose(job.delta, torch.full((12,), -1.0))  # only the new progress
    finally:
        learner.close(flush=False)

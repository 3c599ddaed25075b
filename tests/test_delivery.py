"""The delivery log: progress delivered after a checkpoint is not sent again on restore."""

import json

import torch

import diloco
from diloco.learner.delivery import DeliveryLog, already_delivered
from diloco.learner.link import UploadJob, UploadResult


def test_already_delivered_looks_at_each_fragments_unsent_window():
    # checkpoint at step 100; fragment 0 unsent since step 90, 1 since 98, 2 has nothing unsent
    steps_since = [10, 2, 0, 5]
    accepted = {0: 95, 1: 97, 2: 120, 3: 101, 7: 500}
    # 0: queued at 95 > 90, carried steps 91..95 -> delivered; 1: queued at 97, before its
    # window (98, 100] -> not; 2: nothing to drop; 3: queued after the checkpoint -> delivered;
    # 7: no such fragment
    assert already_delivered(accepted, 100, steps_since) == [0, 3]
    assert already_delivered({}, 100, steps_since) == []


def test_the_log_keeps_the_newest_step_and_survives_garbage(tmp_path):
    path = tmp_path / "delivered.json"
    log = DeliveryLog(path)
    log.record(3, 40)
    log.record(3, 30)  # an older upload answered late: the newest step stays
    log.record(5, 7)
    assert json.loads(path.read_text()) == {"3": 40, "5": 7}
    assert DeliveryLog(path).read() == {3: 40, 5: 7}
    path.write_text('{"3": "x", "-1": 4, "4": 9, "a": 1}')
    assert DeliveryLog(path).read() == {4: 9}
    path.write_text("not json")
    assert DeliveryLog(path).read() == {}
    assert DeliveryLog(tmp_path / "missing.json").read() == {}
    log.clear()
    assert json.loads(path.read_text()) == {}


def make(tmp_path, state=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 2))
    learner = diloco.Learner(
        model,
        syncer="127.0.0.1:1",  # nothing listens: the link retries in the background
        num_fragments=2,
        learner_id="me",
        delivery_file=str(tmp_path / "delivered.json"),
        state=state,
    )
    return model, learner


def test_a_restore_drops_only_the_progress_delivered_after_the_checkpoint(tmp_path):
    model, learner = make(tmp_path)
    try:
        for p in range(2):
            learner.listener.on_fragment(
                p, 1, learner.layout.gather(p, learner.params), frozenset()
            )
        learner.apply_arrived()
        anchors = [a.clone() for a in learner.anchors]
        with torch.no_grad():
            for w in model.parameters():
                w.add_(0.5)  # 6 steps of progress on both fragments, none sent
        learner.local_step, learner.steps_since = 6, [6, 6]
        learner.tokens_since = [60, 60]
        state = learner.state_dict()
        trained = {p: learner.layout.gather(p, learner.params) for p in range(2)}
        # after the checkpoint, fragment 1 went out at step 8 and was accepted; 0 did not
        job = UploadJob(1, 1, 8, 80, torch.zeros(1), 0.0, local_step=8)
        learner.listener.on_result(job, UploadResult("accepted", admitted=1, sent=torch.zeros(1)))
    finally:
        learner.close(flush=False)

    torch.manual_seed(1)
    model2 = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 2))
    with torch.no_grad():  # the worker loads the checkpointed model before the Learner
        for p in range(2):
            learner.layout.scatter(p, trained[p], dict(model2.named_parameters()))
    restored = diloco.Learner(
        model2,
        syncer="127.0.0.1:1",
        num_fragments=2,
        learner_id="me",
        delivery_file=str(tmp_path / "delivered.json"),
        state=state,
    )
    try:
        assert restored.dropped_on_restore == [1]
        assert torch.equal(restored.layout.gather(1, restored.params), anchors[1])
        assert (restored.steps_since[1], restored.tokens_since[1]) == (0, 0)
        assert torch.equal(restored.layout.gather(0, restored.params), trained[0])
        assert (restored.steps_since[0], restored.tokens_since[0]) == (6, 60)
    finally:
        restored.close(flush=False)


def test_a_learner_without_a_checkpoint_starts_a_new_log(tmp_path):
    (tmp_path / "delivered.json").write_text('{"0": 99}')
    _, learner = make(tmp_path)
    try:
        assert json.loads((tmp_path / "delivered.json").read_text()) == {}
    finally:
        learner.close(flush=False)

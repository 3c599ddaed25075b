"""The delivery log: progress delivered after a checkpoint is not sent again on restore."""

import json

import torch

import diloco
from diloco.learner.delivery import DeliveryLog, already_delivered
from diloco.learner.link import UploadJob, UploadResult
from diloco.learner.listener import HeldFates

MERGED = HeldFates()
"""A join reply's ``fates`` that names none of the held ids left out or open: all merged."""


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


def hold_and_train(learner, model) -> list[torch.Tensor]:
    """Give ``learner`` both fragments at version 1, then 6 steps of progress on both, none
    sent; returns the anchors (the global values it holds)."""
    for p in range(2):
        learner.listener.on_fragment(p, 1, learner.layout.gather(p, learner.params), frozenset())
    learner.apply_arrived()
    anchors = [a.clone() for a in learner.anchors]
    with torch.no_grad():
        for w in model.parameters():
            w.add_(0.5)
    learner.local_step, learner.steps_since = 6, [6, 6]
    learner.tokens_since = [60, 60]
    return anchors


def test_a_restore_drops_only_the_progress_delivered_after_the_checkpoint(tmp_path):
    model, learner = make(tmp_path)
    try:
        anchors = hold_and_train(learner, model)
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
        # The previous life trained to step 8 and had them accepted: the worker skips steps
        # 7-8 (their data may be in the global model already); every fragment counts them
        # dropped. Accepted is not merged (its round may have died with its syncer, or left
        # it out) and without a journal nothing can tell: fragment 1's 6 steps are unknown.
        assert restored.ahead_on_restore == 2
        restored.skip(2, tokens=20)
        books = restored.accounting()
        assert (books.trained, restored.total_tokens) == (8, state["total_tokens"] + 20)
        assert books.merged == (0, 0) and books.unknown == (0, 6)
        assert books.unsent == (6, 0) and books.dropped == (2, 2)
        assert books.balanced()
    finally:
        restored.close(flush=False)


def test_a_learner_without_a_checkpoint_starts_a_new_log(tmp_path):
    (tmp_path / "delivered.json").write_text('{"0": 99}')
    _, learner = make(tmp_path)
    try:
        assert json.loads((tmp_path / "delivered.json").read_text()) == {}
    finally:
        learner.close(flush=False)


def test_an_upload_committed_whose_answer_died_with_the_life_is_found_at_the_first_join(
    tmp_path,
):
    # The previous life checkpointed at step 6 (fragment 0: 6 steps unsent), then queued
    # fragment 0 at step 9 and died before the answer: neither the checkpoint nor the
    # delivery log knows; its journal does, and the syncer's commits hold the upload.
    journal = tmp_path / "uploads.jsonl"
    model, learner = make(tmp_path)
    try:
        anchor0 = hold_and_train(learner, model)[0]
        state = learner.state_dict()
    finally:
        learner.close(flush=False)
    journal.write_text(
        '{"life":"old","start":0}\n'
        '{"life":"old","u":77,"p":0,"steps":9,"tokens":90,"step":9}\n'
        '{"life":"old","u":78,"p":1,"steps":'  # a line cut short by the kill
    )
    restored = diloco.Learner(
        model,
        syncer="127.0.0.1:1",
        num_fragments=2,
        learner_id="me",
        delivery_file=str(tmp_path / "delivered.json"),
        journal_file=str(journal),
        state=state,
    )
    try:
        assert restored.dropped_on_restore == [] and restored.ahead_on_restore == 0
        restored.listener.on_rejoin("127.0.0.1:1", "s1", [1, 1], (0, 1), [77], [0, 0], fates=MERGED)
        restored.apply_arrived()
        assert restored.dropped_on_restore == [0] and restored.ahead_on_restore == 3
        assert torch.equal(restored.layout.gather(0, restored.params), anchor0)
        assert restored.steps_since == [0, 6] and restored.merged_steps[0] == 6
        lines = [json.loads(x) for x in journal.read_text().splitlines()[3:]]
        assert {"found_delivered": 0, "steps": 6} | {"life": lines[1]["life"]} in lines
        # A second join (another syncer instance) changes nothing of this.
        restored.listener.on_rejoin("127.0.0.1:1", "s2", [1, 1], (0, 1), [77], [0, 0], fates=MERGED)
        restored.apply_arrived()
        assert restored.merged_steps[0] == 6
    finally:
        restored.close(flush=False)


def test_a_syncer_that_does_not_tell_fates_apart_makes_a_held_upload_unknown(tmp_path):
    """A syncer that predates ``JoinReply.fates`` lists the uploads of its open rounds with
    the committed ones: a held upload of the previous life may never be merged (its round
    may die with that syncer). Its checkpointed progress is neither counted merged nor sent
    again: unknown (issue 46)."""
    journal = tmp_path / "uploads.jsonl"
    model, learner = make(tmp_path)
    try:
        anchor0 = hold_and_train(learner, model)[0]
        state = learner.state_dict()
    finally:
        learner.close(flush=False)
    journal.write_text(
        '{"life":"old","start":0}\n{"life":"old","u":77,"p":0,"steps":9,"tokens":90,"step":9}\n'
    )
    restored = diloco.Learner(
        model,
        syncer="127.0.0.1:1",
        num_fragments=2,
        learner_id="me",
        delivery_file=str(tmp_path / "delivered.json"),
        journal_file=str(journal),
        state=state,
    )
    try:
        restored.listener.on_rejoin("127.0.0.1:1", "s1", [1, 1], (0, 1), [77], [0, 0])
        restored.apply_arrived()
        assert restored.dropped_on_restore == [0] and restored.ahead_on_restore == 3
        assert torch.equal(restored.layout.gather(0, restored.params), anchor0)
        assert restored.steps_since == [0, 6]
        assert restored.unknown_steps[0] == 6 and restored.merged_steps[0] == 0
    finally:
        restored.close(flush=False)


def test_an_upload_of_a_previous_life_older_than_the_kept_logs_is_unknown_not_resent(
    tmp_path,
):
    """Found by the widened torture run (issue 46): as above, but the syncer no longer keeps
    the commit logs of the versions the previous life's upload could have been admitted at
    (``logged_from`` above the checkpoint's version). Taken as "not held", the checkpointed
    progress it carried was sent again and merged twice. Its fate is unknown: the progress
    is dropped (counted unknown, not merged), and the steps it reached are skipped."""
    journal = tmp_path / "uploads.jsonl"
    model, learner = make(tmp_path)
    try:
        anchor0 = hold_and_train(learner, model)[0]
        state = learner.state_dict()
    finally:
        learner.close(flush=False)
    journal.write_text(
        '{"life":"old","start":0}\n{"life":"old","u":77,"p":0,"steps":9,"tokens":90,"step":9}\n'
    )
    restored = diloco.Learner(
        model,
        syncer="127.0.0.1:1",
        num_fragments=2,
        learner_id="me",
        delivery_file=str(tmp_path / "delivered.json"),
        journal_file=str(journal),
        state=state,
    )
    try:
        held = list(restored.versions)
        restored.listener.on_rejoin(
            "127.0.0.1:1", "s1", [9, 9], (0, 1), [], [held[0] + 5, held[1] + 5]
        )
        restored.apply_arrived()
        assert restored.dropped_on_restore == [0] and restored.ahead_on_restore == 3
        assert torch.equal(restored.layout.gather(0, restored.params), anchor0)
        assert restored.steps_since == [0, 6]
        assert restored.unknown_steps[0] == 6 and restored.merged_steps[0] == 0
        lines = [json.loads(x) for x in journal.read_text().splitlines()[2:]]
        assert any(x.get("found_delivered") == 0 and x.get("unknown") for x in lines)
    finally:
        restored.close(flush=False)


def test_a_final_upload_names_the_finals_still_waiting_on_its_link():
    from diloco.learner.uploads import UploadQueue

    queue = UploadQueue(lambda job: 1)
    for fragment, final in ((0, False), (1, True), (2, True)):
        queue.put(UploadJob(fragment, 0, 2, 20, torch.zeros(1), 0.0, final=final))
    assert queue.final_fragments() == [1, 2]
    queue.withdraw(1)  # (a delivered or withdrawn final is no longer named)
    assert queue.final_fragments() == [2]


def test_a_held_queue_sends_nothing_until_released():
    import threading

    from diloco.learner.uploads import UploadQueue

    queue, stop, taken = UploadQueue(lambda job: 1), threading.Event(), []
    with queue.holding():
        queue.put(UploadJob(0, 0, 2, 20, torch.zeros(1), 0.0, final=True))
        sender = threading.Thread(target=lambda: taken.append(queue.take(lambda: True, stop)))
        sender.start()
        sender.join(0.3)
        assert sender.is_alive() and not taken  # held: the job waits
        queue.put(UploadJob(1, 0, 2, 20, torch.zeros(1), 0.0, final=True))
    sender.join(5)
    assert not sender.is_alive() and taken[0].fragment == 0
    assert queue.final_fragments() == [1]


def checkpoint_with_an_unanswered_delta(tmp_path):
    """A life that checkpointed at step 6 with fragment 0's 6 steps queued as upload X (no
    answer yet) and fragment 1's 6 steps unsent; returns (model, state, X, its anchors, the
    trained values, its journal life)."""
    model, learner = make_journaled(tmp_path)
    try:
        anchors = hold_and_train(learner, model)
        assert learner._queue(0)
        (entry,) = learner._ledger.unanswered(0)
        state = learner.state_dict()
        trained = [learner.layout.gather(p, learner.params) for p in range(2)]
        life = learner.journal.life
    finally:
        learner.close(flush=False)
    return model, state, entry.upload_id, anchors, trained, life


def make_journaled(tmp_path, model=None, state=None):
    if model is None:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 2))
    learner = diloco.Learner(
        model,
        syncer="127.0.0.1:1",
        num_fragments=2,
        learner_id="me",
        delivery_file=str(tmp_path / "delivered.json"),
        journal_file=str(tmp_path / "uploads.jsonl"),
        state=state,
    )
    return model, learner


def test_a_checkpointed_delta_a_later_life_had_back_and_sent_again_is_not_resent(tmp_path):
    """Seed 1 of the widened torture run (issue 46): after its checkpoint the previous life
    had upload X refused (returned), sent its 6 steps again with 2 more in upload Y (queued
    at step 8) and Y was accepted; then it died. Resent as it was from the checkpoint, X
    was refused again, returned, and its steps were merged a second time. X is not sent
    again; the first join finds Y among the syncer's commits (accepted alone is not merged):
    X's steps are delivered, counted merged (carried), fragment 0 back at its anchor."""
    model, state, x, anchors, trained, life = checkpoint_with_an_unanswered_delta(tmp_path)
    journal = tmp_path / "uploads.jsonl"
    with open(journal, "a") as f:
        f.write(json.dumps({"life": life, "settled": x, "how": "returned"}) + "\n")
        f.write(json.dumps({"life": life, "u": x + 1, "p": 0, "steps": 8, "step": 8}) + "\n")
    (tmp_path / "delivered.json").write_text('{"0": 8}')
    before = len(journal.read_text().splitlines())
    _, restored = make_journaled(tmp_path, model, state)
    try:
        assert restored._ledger.unanswered(0) == []
        restored.listener.on_rejoin(
            "127.0.0.1:1", "s1", [2, 2], (0, 1), [x + 1], [0, 0], fates=MERGED
        )
        restored.apply_arrived()
        assert restored.merged_steps[0] == 6 and restored.steps_since == [0, 6]
        assert torch.equal(restored.layout.gather(0, restored.params), anchors[0])
        assert torch.equal(restored.layout.gather(1, restored.params), trained[1])
        assert restored.dropped_on_restore == [0] and restored.ahead_on_restore == 2
        lines = [json.loads(x) for x in journal.read_text().splitlines()[before:]]
        assert lines[0]["carried"] == [0, 0]
        assert {"found_delivered": 0, "steps": 6, "life": lines[0]["life"]} in lines
        assert not any("u" in line for line in lines)  # X not sent again
        restored.skip(2, tokens=20)
        assert restored.accounting().balanced()
    finally:
        restored.close(flush=False)


def test_a_checkpointed_delta_a_later_life_had_back_is_undelivered_progress_again(tmp_path):
    """As above, but no upload of fragment 0 after X's return is known accepted: X's steps
    are undelivered progress again (sent with the next delta, unless the first join finds
    the later upload among the syncer's commits), not X sent again as it was."""
    model, state, x, _, trained, life = checkpoint_with_an_unanswered_delta(tmp_path)
    journal = tmp_path / "uploads.jsonl"
    with open(journal, "a") as f:
        f.write(json.dumps({"life": life, "settled": x, "how": "returned"}) + "\n")
        f.write(json.dumps({"life": life, "u": x + 1, "p": 0, "steps": 8, "step": 8}) + "\n")
    before = len(journal.read_text().splitlines())
    _, restored = make_journaled(tmp_path, model, state)
    try:
        assert restored._ledger.unanswered(0) == []
        assert restored.steps_since == [6, 6] and restored.merged_steps == [0, 0]
        assert torch.equal(restored.layout.gather(0, restored.params), trained[0])
        lines = [json.loads(x) for x in journal.read_text().splitlines()[before:]]
        assert not any("u" in line for line in lines)
        # The first join finds Y committed: it carried X's steps, delivered after all.
        restored.listener.on_rejoin(
            "127.0.0.1:1", "s1", [2, 2], (0, 1), [x + 1], [0, 0], fates=MERGED
        )
        restored.apply_arrived()
        assert restored.merged_steps[0] == 6 and restored.steps_since == [0, 6]
        assert restored.ahead_on_restore == 2
    finally:
        restored.close(flush=False)

"""The torture run (issue 32): a real syncer process SIGKILLed and restarted on its state
directory, its disk filled up, learners killed and partitioned, upload replies lost; then
the exactly-once audit of the tape against the learners' journals and books
(``diloco.launch.torture``, ``diloco.report.exactly_once``). ``benchmarks/bench_torture.py``
runs 50 seeds; this is one short schedule, plus the audit's own tests on made-up tapes."""

from __future__ import annotations

import os

import pytest

from diloco.launch.torture import (
    FAULT_KINDS,
    STALL_BOUND_S,
    Torture,
    TortureSpec,
    fault_schedule,
)
from diloco.report.exactly_once import audit, longest_stall


def ci_spec() -> TortureSpec:
    """A 30-second schedule with every fault kind where the disk stays full long enough to
    fail a committing syncer (9-11 s, beyond its ~3 s of retries even when its first write
    comes late: CI saw the first one 4.6 s into a 7.6 s window, while learners restarted
    and were partitioned, and the retries outlasted it) and no kill of the syncer (a kill,
    the one inside the long partition, a rollback's) comes within 4 s before the disk fills
    or 12 s after (so it is up when the disk fills, and fails and exits by itself).

    Without the rollback fault: with a learner resumed from its checkpoint beside a
    restored backup the audit finds the resumed life's checkpoint carrying fewer steps than
    its earlier lives delivered (2 of 3 such seeds of ``bench_torture.py``): open in issue 46
    ("Nothing guessed"). Rollbacks are tested with real syncers in ``test_lineage.py``."""
    for seed in range(300):  # (the syncer kill: the one inside the long partition)
        spec = TortureSpec(
            seed=seed, seconds=30.0, disk_full_s=(9.0, 11.0), syncer_kills=0, rollbacks=0
        )
        faults = fault_schedule(spec)
        (disk,) = [f for f in faults if f.kind == "disk-full"]
        kills = [f for f in faults if f.kind in ("syncer-kill", "rollback")]
        kinds = {f.kind for f in faults}
        if set(FAULT_KINDS) - {"rollback"} <= kinds and all(
            k.at + k.down_s + 4.0 < disk.at or k.at > disk.at + 12.0 for k in kills
        ):
            return spec
    raise AssertionError("no seed below 300 fits")


@pytest.fixture(scope="module")
def tortured(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("the torture run fills a tmpfs: it needs root")
    return Torture(ci_spec(), tmp_path_factory.mktemp("torture")).run()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_step_reaches_the_global_model_exactly_once_through_the_faults(tortured):
    assert tortured.audit.ok, "\n".join(tortured.audit.problems)
    assert tortured.audit.commits > 100 and tortured.audit.uploads_merged > 100


@pytest.mark.slow
def test_every_fault_of_the_schedule_happened(tortured):
    kinds = [f.kind for f in tortured.faults]
    assert tortured.syncer_kills >= 1  # (a kill that finds it down already does nothing)
    assert tortured.syncer_failures >= 1  # it exited non-zero when its disk was full
    assert tortured.syncer_starts >= 1 + tortured.syncer_kills + tortured.syncer_failures
    assert tortured.learner_kills == kinds.count("learner-kill") + kinds.count("learner-resume")
    assert tortured.learner_resumes == kinds.count("learner-resume") >= 1
    # refused while the first served, or a successor once the first had stopped meanwhile
    seconds = tortured.second_syncers_refused + tortured.second_syncers_succeeded
    assert seconds == kinds.count("second-syncer") >= 1
    assert "long-partition" in kinds and "clock-step" in kinds
    assert tortured.rollbacks == kinds.count("rollback")
    assert tortured.zombies_fenced == kinds.count("zombie") >= 1
    assert 1 <= tortured.audit.lives_killed <= tortured.learner_kills  # (one may not have
    # journaled yet: killed while it was starting)
    assert tortured.replies_lost > 0


@pytest.mark.slow
def test_the_run_never_stalled_while_the_syncer_served(tortured):
    assert tortured.audit.longest_stall_s <= STALL_BOUND_S


def test_the_schedule_is_a_pure_function_of_the_spec():
    spec = TortureSpec(seed=7)
    assert fault_schedule(spec) == fault_schedule(spec)
    assert fault_schedule(spec) != fault_schedule(TortureSpec(seed=8))
    kinds = [f.kind for f in fault_schedule(spec)]
    assert sorted(set(kinds) - {"backup"}) == sorted(FAULT_KINDS)


# The audit itself must be able to fail: made-up tapes with each defect it looks for.


def round_record(p, v, uploads, t=0.0):
    return {"event": "round", "t": t, "fragment": p, "version": v, "uploads": uploads}


def journal(life, *uploads):
    return [{"life": life, "start": 0}] + [
        {"life": life, "u": u, "p": p, "steps": s, "tokens": 8 * s, "step": at}
        for u, p, s, at in uploads
    ]


def books(trained, unsent, dropped=(0,), life="A"):
    return {
        "life": life,
        "accounting": {"trained": trained, "unsent": list(unsent), "dropped": list(dropped)},
    }


def test_the_audit_follows_a_learner_resumed_from_its_checkpoint():
    # Life A trained 7 steps and delivered them (4 + 3), was requeued, and life B resumed
    # at step 7 with a checkpoint that holds those 7 as delivered; B trained 5 more.
    tape = [
        round_record(0, 1, {"a": [[1, 4, 32]]}),
        round_record(0, 2, {"a": [[2, 3, 24]]}),
        round_record(0, 3, {"a": [[3, 5, 40]]}),
    ]
    resumed = [{"life": "B", "start": 7, "carried": [7]}, *journal("B", (3, 0, 5, 12))[1:]]
    journals = {"a": journal("A", (1, 0, 4, 4), (2, 0, 3, 7)) + resumed}
    verdict = audit(tape, journals, {"a": books(12, [0], life="B")})
    assert verdict.ok, verdict.problems  # 7 carried + 5 merged = 12 trained
    # A checkpoint that carries fewer steps than the earlier lives delivered: B trains them
    # again and they reach the model twice; one that carries more: steps claimed delivered
    # that no commit holds. Both are named.
    for carried in (4, 9):
        journals["a"][3] = {"life": "B", "start": 7, "carried": [carried]}
        problems = audit(tape, journals, {"a": books(12, [0], life="B")}).problems
        assert any(f"checkpoint carried {carried}" in p for p in problems), problems
    # A checkpoint at step 5 (4 delivered, 1 unsent); A delivered steps 5-7 and was killed.
    # B finds step 5 delivered (carried 5), skips steps 6-7 (counted dropped) and trains 8-12:
    # within the skip the audit accepts it; a skip too short to cover what A delivered, not.
    journals["a"][3] = {"life": "B", "start": 5, "carried": [5]}
    journals["a"].insert(4, {"life": "B", "skipped": 2, "step": 7})
    verdict = audit(tape, journals, {"a": books(12, [0], dropped=[2], life="B")})
    assert verdict.ok, verdict.problems
    journals["a"][4] = {"life": "B", "skipped": 1, "step": 6}
    problems = audit(tape, journals, {"a": books(12, [0], dropped=[2], life="B")}).problems
    assert any("carried 5 (+ 1 skipped)" in p for p in problems), problems


def test_the_audit_passes_an_exact_run_and_names_each_defect():
    tape = [round_record(0, 1, {"a": [[1, 4, 32]]}), round_record(0, 2, {"a": [[2, 3, 24]]})]
    journals = {"a": journal("A", (1, 0, 4, 4), (2, 0, 3, 7))}
    assert audit(tape, journals, {"a": books(9, [2])}).ok  # 4 + 3 merged + 2 unsent = 9
    twice = [*tape, round_record(0, 3, {"a": [[2, 3, 24]]})]
    assert any("again" in p for p in audit(twice, journals, {"a": books(9, [2])}).problems)
    assert any(
        "twice" in p
        for p in audit([*tape, round_record(0, 2, {})], journals, {"a": books(9, [2])}).problems
    )
    gap = [tape[0], round_record(0, 3, {"a": [[2, 3, 24]]})]
    assert any("no record" in p for p in audit(gap, journals, {"a": books(9, [2])}).problems)
    lost = audit(tape, journals, {"a": books(10, [2])}).problems  # one step nowhere
    assert any("!= 10 trained" in p for p in lost)
    disk = audit(tape, journals, {"a": books(9, [2])}, disk_versions={0: 3}).problems
    assert any("on disk" in p for p in disk)
    stranger = audit(tape, {"a": journal("A", (1, 0, 4, 4))}, {"a": books(9, [2])}).problems
    assert any("no journal" in p for p in stranger)


def test_a_killed_life_may_lose_its_tail_but_never_deliver_a_step_twice():
    journals = {"a": journal("K", (1, 0, 4, 4), (2, 0, 4, 6)) + journal("A", (3, 0, 5, 5))}
    finals = {"a": books(5, [0], life="A")}
    fine = [round_record(0, 1, {"a": [[1, 4, 32]]}), round_record(0, 2, {"a": [[3, 5, 40]]})]
    assert audit(fine, journals, finals).ok  # the killed life lost upload 2 (2 steps of 6)
    doubled = [round_record(0, 1, {"a": [[1, 4, 32], [2, 4, 32]]}), fine[1]]
    assert any("killed" in p for p in audit(doubled, journals, finals).problems)


def test_stalls_are_measured_only_while_the_syncer_serves():
    assert longest_stall([2.0, 3.0], (0.0, 10.0), [(4.0, 8.0)]) == 3.0
    assert longest_stall([], (0.0, 10.0), []) == 10.0


def final(trained, unsent, dropped, unknown, life):
    accounting = {"trained": trained, "unsent": unsent, "dropped": dropped, "unknown": unknown}
    return {"life": life, "accounting": accounting}


def test_an_upload_merged_only_by_a_rolled_back_commit_and_sent_again_counts_once():
    """Seed 0 of the widened torture run (issue 46): life A checkpointed at step 7 with
    upload 2 (3 steps) unanswered, had it refused (returned) and died; life B resent it from
    the checkpoint, a commit merged it, a restored backup undid that commit, the restored
    syncer refused the resend again and B sent the 3 steps again with its own 5 (upload 4).
    The global model holds them once: the undone merge is not B's delivery."""
    tape = [
        round_record(0, 1, {"a": [[1, 4, 32]]}),
        round_record(0, 2, {"a": [[2, 3, 24]]}),
        {"event": "rollback", "fragments": [{"fragment": 0, "version": 1}], "receipts": []},
        round_record(0, 2, {"a": [[4, 8, 64]]}),
    ]
    life_a = [
        *journal("A", (1, 0, 4, 4), (2, 0, 3, 7)),
        {"life": "A", "settled": 2, "how": "returned"},
    ]
    life_a += journal("A", (3, 0, 5, 9))[1:]  # (not committed: it died with A)
    life_b = [
        {"life": "B", "start": 7, "carried": [4], "unknown": [0]},
        *journal("B", (2, 0, 3, 7))[1:],  # resent as it was
        {"life": "B", "settled": 2, "how": "returned"},
        *journal("B", (4, 0, 8, 12))[1:],
    ]
    finals = {"a": final(12, [0], [0], [0], "B")}
    verdict = audit(tape, {"a": life_a + life_b}, finals)
    assert verdict.ok, verdict.problems  # 4 carried + 8 merged = 12 trained
    assert verdict.steps_rolled_back == 0  # (sent again: not lost by the rollback)
    # Merged by a commit that stands and sent again all the same: merged twice, named.
    standing = [tape[0], tape[1], round_record(0, 3, {"a": [[4, 8, 64]]})]
    problems = audit(standing, {"a": life_a + life_b}, finals).problems
    assert any("!= 12 trained" in p for p in problems), problems
    # Merged only by the undone commit and taken as merged by B: lost by the rollback (its
    # learner delivered it), counted as B's.
    took = [*life_b[:2], {"life": "B", "settled": 2, "how": "merged", "v": 2}]
    took += journal("B", (4, 0, 5, 12))[1:]
    verdict = audit(
        [*tape[:3], round_record(0, 2, {"a": [[4, 5, 40]]})], {"a": life_a + took}, finals
    )
    assert verdict.ok, verdict.problems  # 4 carried + 3 (undone) + 5 merged = 12
    assert verdict.steps_rolled_back == 3


def test_a_resent_upload_whose_fate_is_unknown_may_be_on_the_tape_under_an_earlier_life():
    """Seeds 3 (and 0) of the widened torture run (issue 46): life A checkpointed at step 5
    with upload 1 (4 steps) unanswered and 1 step unsent, had upload 1 refused (returned)
    and sent its steps again with the rest in upload 2 (7 steps), which a commit merged; A
    died. Life B resent upload 1 from its checkpoint and the syncer could no longer tell its
    fate (nor upload 2's): B counted upload 1's 4 steps and the unsent step unknown, skipped
    2 steps and trained 3. Nothing was merged twice: the 7 steps A delivered are within
    what B's checkpoint holds as delivered, skipped or unknown."""
    tape = [round_record(0, 1, {"a": [[2, 7, 56]]}), round_record(0, 2, {"a": [[3, 3, 24]]})]
    life_a = [*journal("A", (1, 0, 4, 4)), {"life": "A", "settled": 1, "how": "returned"}]
    life_a += journal("A", (2, 0, 7, 7))[1:]
    life_b = [
        {"life": "B", "start": 5, "carried": [0], "unknown": [0]},
        *journal("B", (1, 0, 4, 4))[1:],  # resent as it was
        {"life": "B", "found_delivered": 0, "steps": 1, "unknown": True},
        {"life": "B", "settled": 1, "how": "unknown"},
        {"life": "B", "skipped": 2, "step": 7},
        *journal("B", (3, 0, 3, 10))[1:],
    ]
    finals = {"a": final(10, [0], [2], [5], "B")}
    verdict = audit(tape, {"a": life_a + life_b}, finals)
    assert verdict.ok, verdict.problems
    assert verdict.steps_unknown == 5
    # Seed 1's shape: B's resend of upload 1 refused (returned), its 4 steps and the unsent
    # one sent again (upload 3: 8 steps): A's upload 2 merged them already. Named.
    again = [*life_b[:2], {"life": "B", "settled": 1, "how": "returned"}, life_b[4]]
    again += journal("B", (3, 0, 8, 10))[1:]
    problems = audit(
        [tape[0], round_record(0, 2, {"a": [[3, 8, 64]]})],
        {"a": life_a + again},
        {"a": final(10, [0], [2], [0], "B")},
    ).problems
    assert any("earlier lives delivered 7 steps" in p for p in problems), problems


def test_an_upload_an_earlier_life_journaled_and_the_last_settled_unknown_is_found():
    """The widened torture run's audit crashed (KeyError) on an upload of an earlier life
    (accepted before its checkpoint, never resent) that the last life settled unknown and
    the tape merged: its steps are found in the life that journaled it."""
    tape = [round_record(0, 1, {"a": [[1, 4, 32]]}), round_record(0, 2, {"a": [[2, 3, 24]]})]
    life_a = journal("A", (1, 0, 4, 4))
    life_b = [
        {"life": "B", "start": 4, "carried": [4], "unknown": [0]},  # (in flight)
        {"life": "B", "settled": 1, "how": "unknown"},
        *journal("B", (2, 0, 3, 7))[1:],
    ]
    verdict = audit(tape, {"a": life_a + life_b}, {"a": final(7, [0], [0], [4], "B")})
    assert verdict.ok, verdict.problems  # 3 merged + 4 carried (unknown, merged: once) = 7


def test_an_upload_the_checkpoint_held_in_flight_that_no_commit_merged_leaves_carried():
    """Seed 45 of the quiet widened run (issue 46): life A's upload 1 (4 steps) was accepted
    into a round that died with its syncer; A checkpointed with it in flight (carried) and
    died. Life B settled it unknown at its first join without sending it: its 4 steps are
    unknown, counted once (the audit had counted them carried and unknown: 4 + 3 + 4 != 7).
    Returned instead, they went out again in B's next upload. Merged after all and sent
    again: twice, named."""
    tape = [round_record(0, 1, {"a": [[2, 3, 24]]})]
    life_a = journal("A", (1, 0, 4, 4))
    life_b = [
        {"life": "B", "start": 4, "carried": [4], "unknown": [0]},  # (in flight)
        {"life": "B", "settled": 1, "how": "unknown"},
        *journal("B", (2, 0, 3, 7))[1:],
    ]
    verdict = audit(tape, {"a": life_a + life_b}, {"a": final(7, [0], [0], [4], "B")})
    assert verdict.ok, verdict.problems
    assert verdict.steps_unknown == 4
    returned = [life_b[0], {"life": "B", "settled": 1, "how": "returned"}]
    returned += journal("B", (2, 0, 7, 7))[1:]
    tape = [round_record(0, 1, {"a": [[2, 7, 56]]})]
    verdict = audit(tape, {"a": life_a + returned}, {"a": final(7, [0], [0], [0], "B")})
    assert verdict.ok, verdict.problems
    twice = [round_record(0, 1, {"a": [[1, 4, 32]]}), round_record(0, 2, {"a": [[2, 7, 56]]})]
    problems = audit(twice, {"a": life_a + returned}, {"a": final(7, [0], [0], [0], "B")})
    assert not problems.ok


def test_the_audit_measures_the_longest_stall_beside_the_learners():
    """The stall check reads the tape's round times after each learner was checked: a
    learner's check once shadowed the tape (``'set' object has no attribute 'get'``)."""
    tape = [round_record(0, 1, {"a": [[1, 4, 32]]}), round_record(0, 2, {"a": [[2, 3, 24]]})]
    tape[0]["t"], tape[1]["t"] = 10.0, 30.0
    journals = {"a": journal("A", (1, 0, 4, 4), (2, 0, 3, 7))}
    verdict = audit(tape, journals, {"a": books(9, [2])}, window=(0.0, 40.0), stall_bound_s=60)
    assert verdict.ok and verdict.longest_stall_s == 20.0, (verdict.problems, verdict)
    stalled = audit(tape, journals, {"a": books(9, [2])}, window=(0.0, 40.0), stall_bound_s=15)
    assert any("no commit for 20.0 s" in p for p in stalled.problems), stalled.problems

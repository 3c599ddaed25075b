"""Chaos spec parsing and schedules; goodput, uptime and reintegration from a tape."""

import pytest

from diloco.chaos import ChaosSpecError, parse_spec, schedule
from diloco.report.goodput import down_accounting, schedule_down, uptime
from diloco.report.tally import busy_rate, learner_speed, tape_metrics


def test_spec_parses_all_kinds():
    clauses = parse_spec(
        "kill:mtbf=60s,down=5-15s; hang:mtbf=2m,down=3s,learners=0+2;syncer-kill:at=120"
    )
    assert [c.kind for c in clauses] == ["kill", "hang", "syncer-kill"]
    assert clauses[0].mtbf_s == 60 and clauses[0].down_s == (5, 15)
    assert (
        clauses[1].mtbf_s == 120 and clauses[1].learners == (0, 2) and clauses[1].down_s == (3, 3)
    )
    assert clauses[2].at_s == 120
    assert parse_spec("") == []


@pytest.mark.parametrize(
    "spec, message",
    [
        ("explode:mtbf=1", "unknown kind"),
        ("kill:down=1", "mtbf"),
        ("kill:mtbf=x", "is not a duration"),
        ("kill:mtbf=5,down=9-3", "reversed"),
        ("kill:mtbf=5,colour=red", "unknown key"),
        ("kill:mtbf", "key=value"),
        ("syncer-kill:down=3", "at="),
    ],
)
def test_bad_specs_name_the_clause(spec, message):
    with pytest.raises(ChaosSpecError, match=message):
        parse_spec(spec)


def test_schedule_is_seeded_sorted_and_respects_the_horizon():
    clauses = parse_spec("kill:mtbf=20s,down=5-15s;syncer-kill:at=50s,down=2s")
    a = schedule(clauses, 3, 600, seed=1)
    assert a == schedule(clauses, 3, 600, seed=1)
    assert a != schedule(clauses, 3, 600, seed=2)
    assert a == sorted(a) and all(5 < e.t <= 600 for e in a)
    assert sum(e.kind == "syncer-kill" for e in a) == 1
    for target in ("learner-0", "learner-1", "learner-2"):
        mine = [e for e in a if e.target == target]
        assert 10 < len(mine) < 60  # about 600 / (20 + 10) failures each
        for first, second in zip(mine, mine[1:], strict=False):
            assert second.t >= first.t + first.down_s  # the next failure waits for the restart
        assert all(5 <= e.down_s <= 15 for e in mine)


def test_network_kinds_drop_and_delay():
    clauses = parse_spec("drop:mtbf=10s;delay:at=20s,down=4s,latency=300ms,learners=1")
    assert clauses[1].latency_s == pytest.approx(0.3)
    assert parse_spec("delay:mtbf=1m")[0].latency_s == 0.2  # the default
    events = schedule(clauses, 2, 120, seed=3)
    drops = [e for e in events if e.kind == "drop"]
    assert drops and all(e.down_s == 0 and e.latency_s == 0 for e in drops)
    assert {e.target for e in drops} == {"learner-0", "learner-1"}
    (delay,) = [e for e in events if e.kind == "delay"]
    assert (delay.t, delay.target, delay.down_s, delay.latency_s) == (20, "learner-1", 4, 0.3)
    with pytest.raises(ChaosSpecError, match="mtbf"):
        parse_spec("drop:latency=1s")


def test_fixed_time_failures_and_unknown_learners():
    events = schedule(parse_spec("hang:at=7s,down=2s,learners=1"), 2, 60, seed=0)
    assert [(e.t, e.kind, e.target, e.down_s) for e in events] == [(7, "hang", "learner-1", 2)]
    with pytest.raises(ChaosSpecError, match="does not exist"):
        schedule(parse_spec("kill:mtbf=5,learners=4"), 2, 60, seed=0)


def tape():
    rounds = []
    for i in range(100):  # a commit every 0.1 s from t=1 to t=11 by learner a, b joins later
        t = 1 + i * 0.1
        who = ["a"] if t < 6 else ["a", "b"]
        rounds.append(
            {
                "event": "round",
                "t": t,
                "participants": who,
                "tokens_by_learner": {m: 10 * 4 for m in who},  # 4 fragments, 10 tokens each
            }
        )
    rounds = [r for r in rounds if not 4 <= r["t"] < 5]  # a one-second outage
    return [
        {"event": "join", "t": 1.0, "learner": "a"},
        {"event": "join", "t": 1.0, "learner": "ev", "observer": True},
        {"event": "chaos", "t": 4.0, "kind": "syncer-kill", "target": "syncer", "down_s": 1},
        {"event": "join", "t": 5.5, "learner": "b"},
        {"event": "restart", "t": 5.5, "target": "b"},
        *rounds,
    ]


def test_tape_metrics():
    m = tape_metrics(tape(), fragments=4, end=11.0, speeds={"a": 100.0, "b": 100.0})
    assert m["useful_tokens"] == {"a": 900, "b": 500}
    assert m["provisioned_tokens"] == {"a": 1000, "b": 550}
    assert m["goodput"] == pytest.approx(1400 / 1550)
    assert m["max_commit_gap_s"] == pytest.approx(1.1)
    assert m["uptime"] == pytest.approx(0.93, abs=0.005)
    assert m["failures_injected"] == [
        {"t": 4.0, "kind": "syncer-kill", "target": "syncer", "down_s": 1}
    ]
    assert m["reintegrations"][0]["learner"] == "b"
    assert m["reintegrations"][0]["reintegration_s"] == pytest.approx(0.5)


def test_schedule_down_counts_only_the_schedules_own_down_time():
    chaos = [
        {"t": 2.0, "kind": "kill", "target": "a", "down_s": 3.0},
        {"t": 9.0, "kind": "kill", "target": "a", "down_s": 5.0},  # cut at the end (t=11)
        {"t": 3.0, "kind": "hang", "target": "b", "down_s": 1.0},
        {"t": 4.0, "kind": "syncer-kill", "target": "syncer", "down_s": 1.0},  # not a learner
        {"t": 5.0, "kind": "drop", "target": "b", "down_s": 0.0},
        {"t": 6.0, "kind": "partition", "target": "b", "down_s": 4.0},  # it keeps training
    ]
    down = schedule_down(chaos, {"a", "b"}, end=11.0)
    assert down == {"a": pytest.approx(5.0), "b": pytest.approx(1.0)}  # seconds
    assert down_accounting(800.0, 1000.0, 200.0) == {
        "down_share": pytest.approx(0.2),
        "goodput_up": pytest.approx(1.0),
    }
    assert down_accounting(0.0, 0.0, 0.0) == {"down_share": None, "goodput_up": None}


def test_tape_metrics_split_the_schedules_down_time_from_the_rest():
    records = tape() + [{"event": "chaos", "t": 2.0, "kind": "kill", "target": "a", "down_s": 2}]
    m = tape_metrics(records, fragments=4, end=11.0, speeds={"a": 100.0, "b": 100.0})
    assert m["down_share"] == pytest.approx(200 / 1550)
    assert m["goodput_up"] == pytest.approx(1400 / 1350)  # the toy tape delivers while down


def test_busy_rate_counts_tokens_per_second_of_compute_within_incarnations():
    progress = [
        {"t": 0, "tokens": 0, "busy_s": 0.0},
        {"t": 1, "tokens": 100, "busy_s": 0.5},  # half of the second spent waiting
        {"t": 2, "tokens": 300, "busy_s": 1.0},
        {"t": 30, "tokens": 200, "busy_s": 0.2},  # restored: counters went back, skipped
        {"t": 31, "tokens": 400, "busy_s": 1.2},
        {"t": 32, "event": "exit", "tokens": 400},
    ]
    assert busy_rate(progress) == pytest.approx((100 + 200 + 200) / (0.5 + 0.5 + 1.0))
    assert busy_rate([{"t": 0, "tokens": 0}, {"t": 1, "tokens": 100}]) is None


def test_goodput_counts_time_so_survivors_cannot_use_a_dead_learners_cores():
    """Two learners share the cores: while a is down (t 10-20), b trains twice as fast. Every
    token of both reaches the model. Measured in tokens at the median speed, goodput would
    credit b's extra speed (the shared-machine artefact); in busy time it is exactly the
    share of time the learners were up."""
    joins = [{"event": "join", "t": 0.0, "learner": m} for m in ("a", "b")]
    kill = {"event": "chaos", "t": 10.0, "kind": "kill", "target": "a", "down_s": 10.0}
    rounds = [  # one fragment; a delivers 100 tokens/s up, b 100 tokens/s (200 while a is down)
        {"event": "round", "t": 30.0, "participants": ["a", "b"],
         "tokens_by_learner": {"a": 100 * 20, "b": 100 * 20 + 200 * 10}},
    ]  # fmt: skip
    speeds = {"a": 100.0, "b": 100.0}  # medians
    rates = {"a": 100.0, "b": (100 * 20 + 200 * 10) / 30}  # b was busy all 30 s
    m = tape_metrics(joins + [kill] + rounds, fragments=1, end=30.0, speeds=speeds, rates=rates)
    assert m["goodput_speed"] == pytest.approx(6000 / 6000)  # a's down time looks recovered
    assert m["goodput"] == pytest.approx(50 / 60)  # 20 s of a + 30 s of b, of 60 s
    assert m["down_share"] == pytest.approx(10 / 60)
    assert m["goodput_up"] == pytest.approx(1.0)


def test_uptime_edges_and_learner_speed():
    assert uptime([], 0, 10) == 0.0
    batched = [t / 10 for t in range(100) for _ in range(3)]  # 3 commits per poll, 10 polls/s
    assert uptime(batched, 0, 10) == pytest.approx(1.0)
    assert uptime([1.0], 5, 5) == 0.0
    progress = [
        {"t": 0, "tokens": 0},
        {"t": 1, "tokens": 100},
        {"t": 2, "tokens": 200},
        {"t": 30, "tokens": 50},  # restarted from a checkpoint: skipped
        {"t": 31, "tokens": 150},
        {"t": 32, "event": "exit", "tokens": 160},
    ]
    assert learner_speed(progress) == 100
    assert learner_speed([]) == 0.0


def test_disk_full_and_lost_replies_are_chaos_kinds():
    """Issue 46, item 7: ``diloco run --chaos`` had no ``disk-full`` and no ``lose-replies``
    (only the torture run had them). A full disk is the syncer's, at a fixed time; lost
    replies are a learner's network fault with the probability ``p``."""
    clauses = parse_spec("disk-full:at=30s,down=8s;lose-replies:mtbf=20s,down=5s,p=0.3")
    assert [c.kind for c in clauses] == ["disk-full", "lose-replies"]
    assert clauses[1].probability == pytest.approx(0.3)
    assert parse_spec("lose-replies:at=9s")[0].probability == 0.5  # the default
    events = schedule(clauses, 2, 120, seed=4)
    (full,) = [e for e in events if e.kind == "disk-full"]
    assert (full.t, full.target, full.down_s) == (30, "syncer", 8)
    losses = [e for e in events if e.kind == "lose-replies"]
    assert losses and all(e.probability == pytest.approx(0.3) and e.down_s == 5 for e in losses)
    for spec, message in (
        ("disk-full:down=3s", "at="),
        ("lose-replies:down=3s", "mtbf"),
        ("lose-replies:at=3s,p=1.5", "probability"),
        ("lose-replies:at=3s,p=nan", "probability"),
        ("kill:at=3s,p=0.5", "unknown key"),
    ):
        with pytest.raises(ChaosSpecError, match=message):
            parse_spec(spec)

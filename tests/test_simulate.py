"""The failure simulator: event logic on hand-computed cases, calibration claims, CLI, twin."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from diloco.algorithm.rounds import Estimates, OpenRound, decide_round
from diloco.cli import main as cli_main
from diloco.config import RecipeConfig, to_dict
from diloco.config.run import RunConfig
from diloco.report.run_files import NotARun
from diloco.sim.calibrate import max_residual_points, nelder_mead, row_goodput
from diloco.sim.failures import Recovery, draw_outages, merge_outages
from diloco.sim.grid import (
    PAPER_DP,
    PAPER_DP_ELASTIC,
    Row,
    SimConfig,
    mean_ci,
    score,
    simulate,
    summarize,
)
from diloco.sim.modes import (
    dp_accounting,
    elastic_accounting,
    first_stops,
    quorum_table,
    speed_factor,
)
from diloco.sim.twin import MachineConstants, RunFacts, measure_constants, predict, twin_report
from diloco.wire.comms import DEFAULT_SETTING

pytestmark = pytest.mark.timeout(60)


def one_failure(slices: int = 4, at: float = 300.0, back: float = 500.0, horizon: float = 1000.0):
    """Slice 2 of ``slices`` fails at ``at`` and is back at ``back``."""
    return merge_outages(
        np.array([2]), np.array([at]), np.array([back]), slices=slices, horizon_s=horizon
    )


# ---------------------------------------------------------------- hand-computed single failure


def test_dp_single_failure_stop_restart_and_rework():
    # up 300 s, then stop: restart 50 s + re-work of 300 mod 120 = 60 s -> back at 410
    r = dp_accounting(one_failure(), restart_s=50.0, checkpoint_s=120.0)
    assert r.goodput == pytest.approx((300 + (1000 - 410)) / 1000)
    assert r.uptime == pytest.approx(r.goodput)


def test_dp_failure_during_a_stop_is_absorbed_and_a_later_one_is_not():
    o = merge_outages(
        np.array([2, 1, 3]),
        np.array([300.0, 350.0, 500.0]),
        np.array([400.0, 360.0, 510.0]),
        slices=4,
        horizon_s=1000.0,
    )
    # 300: stop until 410 (350 absorbed); 500: up 90, stop 50 + 90 -> back at 640
    r = dp_accounting(o, restart_s=50.0, checkpoint_s=120.0)
    assert r.goodput == pytest.approx((300 + 90 + 360) / 1000)


def test_dp_elastic_single_failure_pauses_then_runs_on_three_quarters():
    r = elastic_accounting(one_failure(), groups=1, quorum=1, reconfig_s=20.0, readd_s=10.0)
    # [0,300] full; [300,320] pause; [320,500] 3/4; [500,510] re-add pause; [510,1000] full
    assert r.goodput == pytest.approx((300 + 0.75 * 180 + 490) / 1000)
    assert r.uptime == pytest.approx(970 / 1000)


def test_decoupled_single_failure_loses_only_that_learners_share():
    r = elastic_accounting(one_failure(), groups=4, quorum=1, reconfig_s=20.0, readd_s=10.0)
    # learner 2 (one slice) is out from 300 to 510 (down, then re-add pause); others unaffected
    assert r.goodput == pytest.approx(1 - 210 / 1000 / 4)
    assert r.uptime == pytest.approx(1.0)


def test_decoupled_quorum_of_all_stops_progress_while_a_live_learner_pauses():
    r = elastic_accounting(one_failure(), groups=4, quorum=4, reconfig_s=20.0, readd_s=10.0)
    # [300,500]: learner 2 is not live, the 3 live ones all contribute -> rounds close
    # [500,510]: learner 2 is live but re-adding (not contributing), 3 < K = 4 -> no progress
    assert r.goodput == pytest.approx(1 - (210 / 4 + 0.75 * 10) / 1000)
    assert r.uptime == pytest.approx(990 / 1000)


def test_decoupled_with_one_learner_is_elastic_data_parallel():
    rng = np.random.default_rng(3)
    o = draw_outages(
        rng, slices=40, slice_chips=8, mtbi_s=3e4, recovery=Recovery(mean_s=300), horizon_s=1e5
    )
    cfg = SimConfig(reconfig_s=30.0, readd_s=5.0)
    one = score(Row("decoupled", 1), o, cfg, np.random.default_rng(0))
    elastic = score(Row("dp-elastic", 1), o, cfg, np.random.default_rng(0))
    assert one == elastic and one.goodput < 1.0


def test_more_learners_lose_less_to_the_same_failures():
    rng = np.random.default_rng(0)
    o = draw_outages(
        rng, slices=64, slice_chips=16, mtbi_s=1e5, recovery=Recovery(mean_s=600), horizon_s=2e5
    )
    g = [
        elastic_accounting(o, groups=m, quorum=1, reconfig_s=60.0, readd_s=0.0).goodput
        for m in (1, 2, 8, 64)
    ]
    assert g == sorted(g) and g[0] < g[-1]


# ---------------------------------------------------------------- building blocks


def test_merge_outages_joins_overlaps_of_one_slice_only():
    o = merge_outages(
        np.array([0, 0, 1, 0]),
        np.array([10.0, 15.0, 12.0, 40.0]),
        np.array([20.0, 30.0, 13.0, 41.0]),
        slices=2,
        horizon_s=100.0,
    )
    got = sorted(zip(o.slice_id.tolist(), o.start.tolist(), o.end.tolist(), strict=True))
    assert got == [(0, 10.0, 30.0), (0, 40.0, 41.0), (1, 12.0, 13.0)]


def test_first_stops_absorbs_events_inside_a_stop_per_group():
    t = np.array([0.0, 5.0, 10.0, 3.0])
    g = np.array([0, 0, 0, 1])
    mask = first_stops(t, g, np.full(4, 6.0))
    assert mask.tolist() == [True, False, True, True]


def test_quorum_table_is_decide_round():
    table = quorum_table(3, 2)
    ids = ["learner-0", "learner-1", "learner-2"]
    for live in range(4):
        for c in range(live + 1):
            d = decide_round(
                0.0,
                OpenRound(frozenset(ids[:c]), 0.0, 0.0 if c >= 2 else None),
                ids[:live],
                quorum=2,
                gamma=1.0,
                tau=2.0,
                estimates=Estimates(),
            )
            assert table[c, live] == d.close
    assert table[1, 1] and table[2, 3] and not table[1, 3] and not table[0, 0]


def test_failure_count_and_recovery_mean_follow_the_rates():
    rng = np.random.default_rng(1)
    o = draw_outages(
        rng,
        slices=100,
        slice_chips=10,
        mtbi_s=1000.0,
        recovery=Recovery(kind="fixed", mean_s=0.01),
        horizon_s=10_000.0,
    )
    assert abs(o.start.size - 10_000) < 400  # Poisson(10_000): 4 sigma (a few merged)
    length = o.end - o.start
    assert (length >= 0.01 - 1e-6).all() and np.mean(np.isclose(length, 0.01)) > 0.99
    x = Recovery(kind="lognormal", mean_s=100.0, sigma=1.0).draw(np.random.default_rng(0), 200_000)
    assert x.mean() == pytest.approx(100.0, rel=0.02)
    with pytest.raises(ValueError):
        Recovery(kind="weibull")


def test_speed_factor():
    rng = np.random.default_rng(0)
    assert speed_factor(rng, slices=10, groups=1, sigma=0.0) == 1.0
    assert speed_factor(rng, slices=10, groups=10, sigma=0.3) == pytest.approx(1.0)
    assert speed_factor(rng, slices=100, groups=1, sigma=0.1) < 0.9


def test_mean_ci():
    m, ci = mean_ci(np.array([1.0, 2.0, 3.0]))
    assert m == 2.0 and ci == pytest.approx(4.303 * 1.0 / np.sqrt(3))


def test_nelder_mead_finds_a_quadratic_minimum():
    x, f = nelder_mead(lambda v: (v[0] - 1) ** 2 + 3 * (v[1] + 2) ** 2, np.zeros(2), np.ones(2))
    assert np.allclose(x, [1, -2], atol=1e-2) and f < 1e-3


# ---------------------------------------------------------------- calibration claims


SHORT = replace(SimConfig(), horizon_s=2 * 86400)


def test_defaults_reproduce_the_published_data_parallel_rows_within_3_points():
    assert max_residual_points(row_goodput("dp", SHORT, 3), PAPER_DP) <= 3.0
    assert max_residual_points(row_goodput("dp-elastic", SHORT, 3), PAPER_DP_ELASTIC) <= 3.0


def test_defaults_sit_at_the_fit_optimum():
    base = max_residual_points(row_goodput("dp", SHORT, 3), PAPER_DP)
    for kw in ({"restart_s": SHORT.restart_s * 1.3}, {"restart_s": SHORT.restart_s * 0.7}):
        assert max_residual_points(row_goodput("dp", replace(SHORT, **kw), 3), PAPER_DP) > base
    el = max_residual_points(row_goodput("dp-elastic", SHORT, 3), PAPER_DP_ELASTIC)
    for r in (SHORT.reconfig_s * 1.3, SHORT.reconfig_s * 0.7):
        cfg = replace(SHORT, reconfig_s=r)
        assert max_residual_points(row_goodput("dp-elastic", cfg, 3), PAPER_DP_ELASTIC) > el


def test_simulate_is_deterministic_in_its_seeds():
    rows = [Row("dp", 1), Row("decoupled", 4)]
    cfg = replace(SimConfig(), horizon_s=86400.0)
    a = summarize(simulate((150_000,), rows, cfg, 2))
    b = summarize(simulate((150_000,), rows, cfg, 2))
    assert a == b


# ---------------------------------------------------------------- CLI


def test_cli_table_json(capsys):
    code = cli_main(["simulate", "--table", "--json", "--seeds", "2", "--duration", "12h"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    keys = {(c["mode"], c["learners"]) for c in out["cells"]}
    assert keys == {("dp", 1), ("dp-elastic", 1)} | {("decoupled", m) for m in (2, 4, 8, 16)}
    assert len(out["cells"]) == 6 * 5
    assert all(0.0 <= c["goodput"] <= 1.0 for c in out["cells"])


@pytest.mark.parametrize(
    "argv",
    [
        ["--seeds", "1"],
        ["--chips", "0"],
        ["--duration", "abc"],
        ["--mode", "decoupled", "--learners", "2", "--quorum", "3"],
        ["--chips", "2000", "--slice-chips", "1024"],
        ["--recovery-mean", "-5"],
        ["--twin", "/nonexistent/run"],
    ],
)
def test_cli_rejects_bad_input_with_exit_2(argv):
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(cli_main(["simulate", *argv]))
    assert exc.value.code == 2


# ---------------------------------------------------------------- twin


def test_twin_prediction_of_one_known_kill():
    config = RunFacts(
        learners=1, minutes=1.0, chaos="kill:at=20s,down=5s", seed=0, sync_every=24, quorum=1
    )
    c = MachineConstants(startup_s=0.0, restart_s=5.0, steps_per_s=12.0)
    # lost: 12 undelivered steps (H = 24) = 1 s before the kill; down 5 s + restart 5 s after it
    assert predict(config, c, seed=0) == pytest.approx(1 - 11 / 60)
    hang = replace(config, chaos="hang:at=20s,down=5s")
    assert predict(hang, c, seed=0) == pytest.approx(1 - 5 / 60)
    two = replace(config, learners=2, chaos="kill:at=20s,down=5s,learners=1")
    assert predict(two, c, seed=0) == pytest.approx(1 - 11 / 120)


def test_dp_counts_every_failure_and_ignores_recovery_times():
    def outages(mean_s):
        return draw_outages(
            np.random.default_rng(5),
            slices=8,
            slice_chips=100,
            mtbi_s=1e6,
            recovery=Recovery(kind="fixed", mean_s=mean_s),
            horizon_s=1e5,
        )

    short, long = outages(1.0), outages(5e4)
    assert long.start.size < short.start.size  # long outages merge repeated slice failures
    assert long.failure_times().size == short.failure_times().size
    a = dp_accounting(short, restart_s=30.0, checkpoint_s=60.0)
    b = dp_accounting(long, restart_s=30.0, checkpoint_s=60.0)
    assert a == b


def _fake_run(tmp_path, *, seed: int = 0):
    """A run directory as ``diloco run`` leaves it: one learner killed once at 20 s."""
    run = tmp_path / "run"
    (run / "syncer").mkdir(parents=True)
    (run / "learners" / "learner-0").mkdir(parents=True)
    config = RunConfig(
        learners=1, minutes=1.0, recipe=RecipeConfig(seed=seed), chaos="kill:at=20s,down=5s"
    )
    data = to_dict(config)
    (run / "config.json").write_text(json.dumps(data))
    launch = 1000.0
    tape = [
        {"event": "start", "t": launch},
        {"event": "join", "t": launch + 4.0, "learner": "learner-0", "observer": False},
        {"event": "chaos", "t": launch + 20.0, "kind": "kill", "target": "learner-0", "down_s": 5},
        {"event": "restart", "t": launch + 25.0, "target": "learner-0"},
    ]
    (run / "syncer" / "events.jsonl").write_text("\n".join(json.dumps(r) for r in tape))
    # 10 steps/s while training (records 1 s apart), back 3 s after the restart
    progress = [
        {"t": launch + t, "step": 10 * i, "tokens": 10_240 * i, "steps_per_s": 10.0}
        for i, t in enumerate(range(5, 20))
    ] + [
        {"t": launch + t, "step": 10 * i, "tokens": 10_240 * i, "steps_per_s": 10.0}
        for i, t in enumerate(range(28, 60))
    ]
    (run / "learners" / "learner-0" / "progress.jsonl").write_text(
        "\n".join(json.dumps(p) for p in progress)
    )
    (run / "summary.json").write_text(json.dumps({"goodput": 0.7, "uptime": 0.9}))
    return run


def test_twin_measures_constants_and_reports(tmp_path):
    run = _fake_run(tmp_path)
    c = measure_constants(run)
    assert (c.startup_s, c.restart_s, c.steps_per_s) == (4.0, 3.0, 10.0)
    assert c.speed_ratio == pytest.approx(1.0)
    report = twin_report(run, c, seeds=3)
    # from the join (4 s) to the end (60 s): lost H/2 undelivered steps at 10 steps/s (0.8 s
    # at the default H = 16) + 5 s down + 3 s
    lost_s = DEFAULT_SETTING.sync_every / 2 / 10.0
    assert report["predicted_goodput"] == pytest.approx(1 - (lost_s + 5 + 3) / 56)
    assert report["measured_goodput"] == 0.7
    assert report["error_points"] == pytest.approx(100 * (report["predicted_goodput"] - 0.7))


def test_twin_reads_an_unfinished_run_and_refuses_a_directory_without_its_tape(tmp_path):
    """The twin reads runs through the report's one loader: no ``summary.json`` is fine (no
    measured goodput), no ``config.json`` or event tape is not a run."""
    run = _fake_run(tmp_path)
    (run / "summary.json").unlink()
    c = measure_constants(run)
    report = twin_report(run, c, seeds=3)
    assert report["measured_goodput"] is None and report["measured_uptime"] is None
    (run / "syncer" / "events.jsonl").unlink()
    with pytest.raises(NotARun, match="need config.json"):
        twin_report(run, c, seeds=3)

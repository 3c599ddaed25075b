"""The bandwidth planner: formulas, the documented worked example, CLI validation."""

from __future__ import annotations

import argparse
import json

import pytest

from diloco.cli import main as cli_main
from diloco.cli.plan import link_rate, parse_count
from diloco.plan import (
    PlanInputs,
    comms_bandwidths,
    decoupled_bandwidth_bps,
    dp_bandwidth_bps,
    dp_time_budget_s,
    plan,
    recommend,
    ring_factor,
    with_comms,
)

pytestmark = pytest.mark.timeout(30)


def test_ring_factor():
    assert ring_factor(2) == 1.0
    assert ring_factor(8) == 1.75
    assert ring_factor(4) == 1.5


def test_dp_bandwidth_by_hand():
    # 1e9 params, 16 bits, 2 sites (ring factor 1): 1.6e10 bits per step;
    # u = 0.5 -> budget t·(1/u − 1) = 1 s of a 1 s step
    p = PlanInputs(params=1e9, step_time_s=1.0, sites=2, dp_bits=16, utilization=0.5)
    assert dp_time_budget_s(p) == pytest.approx(1.0)
    assert dp_bandwidth_bps(p) == pytest.approx(1.6e10)
    # overlap adds budget: o = 1 doubles it
    assert dp_bandwidth_bps(PlanInputs(**{**p.__dict__, "dp_overlap": 1.0})) == pytest.approx(8e9)
    # a higher utilization target needs more bandwidth: u = 0.9 -> budget 1/9 s
    p9 = PlanInputs(params=1e9, step_time_s=1.0, sites=2, dp_bits=16, utilization=0.9)
    assert dp_bandwidth_bps(p9) == pytest.approx(1.6e10 * 9)


def test_decoupled_bandwidth_by_hand():
    # N/H values per step at max(up, down) bits: 1e9/24 * 4 bits / 1 s
    p = PlanInputs(params=1e9, step_time_s=1.0, up_bits=4, down_bits=4)
    assert decoupled_bandwidth_bps(p) == pytest.approx(1e9 * 4 / 24)
    # bf16 down dominates a full-duplex link
    assert decoupled_bandwidth_bps(PlanInputs(params=1e9, step_time_s=1.0, down_bits=16)) == (
        pytest.approx(1e9 * 16 / 24)
    )
    # few fragments: each (N/P values) must cross within tau steps
    burst = PlanInputs(params=1e9, step_time_s=1.0, num_fragments=2, sync_every=24, tau=2.0)
    assert decoupled_bandwidth_bps(burst) == pytest.approx(1e9 * 4 / 4)


def test_worked_example_reproduces_the_papers_pair():
    """docs/plan.md: 12B parameters, 8 sites, 2.381 s/step, u = 0.9, 60.16% overlap."""
    p = PlanInputs(params=12e9, step_time_s=2.381, sites=8, utilization=0.9, dp_overlap=0.6016)
    out = plan(p)
    assert out["dp_gbps"] == pytest.approx(198, rel=0.005)
    assert out["decoupled_gbps"] == pytest.approx(0.84, rel=0.005)
    assert out["ratio"] == pytest.approx(198 / 0.84, rel=0.01)


@pytest.mark.parametrize(
    "kw",
    [
        {"sites": 1},
        {"utilization": 1.0},
        {"utilization": 0.0},
        {"dp_overlap": 1.5},
        {"tau": 0.0},
        {"up_bits": 0},
        {"step_time_s": 0.0},
    ],
)
def test_inputs_are_validated(kw):
    with pytest.raises(ValueError):
        PlanInputs(**{"params": 1e9, "step_time_s": 1.0, **kw})


def test_parse_count():
    assert parse_count("12B") == 12e9
    assert parse_count("350m") == 350e6
    assert parse_count("1e9") == 1e9


def test_cli(capsys):
    argv = ["plan", "--params", "12B", "--step-time", "2.381", "--utilization", "0.9"]
    assert cli_main([*argv, "--dp-overlap", "0.6016", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["decoupled_gbps"] == pytest.approx(0.84, rel=0.005)
    assert cli_main([*argv, "--sites", "1"]) == 2
    assert "sites must be >= 2" in capsys.readouterr().err


def test_each_named_setting_is_priced_and_the_densest_that_fits_is_recommended():
    p = PlanInputs(params=12e9, step_time_s=2.381, sites=8)
    gbps = {name: bps / 1e9 for name, bps in comms_bandwidths(p).items()}
    # default: int2 down dominates (2.25 bits per value: two bits and a float32 per 128),
    # H = 16: 12e9 · 2.25 / 2.381 / 16
    assert gbps["default"] == pytest.approx(12e9 * 2.25 / 2.381 / 16 / 1e9, rel=1e-6)
    assert gbps["default"] > gbps["low"] > gbps["lowest"]
    # low: H = 24, sign1 both ways (1.25 bits per value: a bit and a float32 per 128)
    assert gbps["low"] == pytest.approx(12e9 * 1.25 / 2.381 / 24 / 1e9, rel=1e-6)
    # lowest: H = 128, sign1w both ways (1.03125 bits per value: a float32 per 1024); τ at
    # least H/P steps (the clock's next ask), so the burst term 1/(P·τ) does not price it
    # as H = 2P = 48
    assert gbps["lowest"] == pytest.approx(12e9 * 1.03125 / 2.381 / 128 / 1e9, rel=1e-6)
    assert with_comms(p, "lowest").tau == pytest.approx(128 / 24)
    assert with_comms(p, "default").tau == 2.0
    assert recommend(p, 10e9) == "default"
    assert recommend(p, 1e9) == "default"
    assert recommend(p, 0.5e9) == "low"
    assert recommend(p, 0.05e9) == "lowest"
    assert recommend(p, 0.04e9) is None
    assert with_comms(p, "lowest").sync_every == 128


def test_cli_says_which_comms_a_link_needs(capsys):
    argv = ["plan", "--params", "12B", "--step-time", "2.381"]
    assert cli_main([*argv, "--link", "500Mbps"]) == 0
    assert "a 0.5 Gbps link: --comms low" in capsys.readouterr().out
    assert cli_main([*argv, "--link", "20Mbps", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recommended_comms"] is None and out["link_gbps"] == pytest.approx(0.02)
    assert set(out["comms_gbps"]) == {"default", "low", "lowest"}
    assert cli_main([*argv, "--comms", "lowest", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"]["sync_every"] == 128
    with pytest.raises(SystemExit):
        cli_main([*argv, "--link", "fast"])
    assert "is not a link rate" in capsys.readouterr().err


def test_link_rates_in_plan_and_wan_spellings_and_a_bare_number_is_gbps():
    assert link_rate("1Gbps") == 1e9
    assert link_rate("200Mbit") == 200e6
    assert link_rate("2.5g") == 2.5e9
    assert link_rate("0.5") == 0.5e9  # a bare number: Gbit/s, as docs/plan.md says
    assert link_rate("50mbit") == link_rate("50Mbps") == 50e6  # --wan's spelling too
    assert link_rate("1.5Gbit") == 1.5e9 and link_rate("300kbit") == 3e5
    for bad in ("fast", "none", "-1Gbps", "0", "0mbit", "mbit", "1 gigabit"):
        with pytest.raises(argparse.ArgumentTypeError, match="link rate"):
            link_rate(bad)


def test_a_bare_link_number_plans_as_many_gbps_as_the_unit_spelling(capsys):
    argv = ["plan", "--params", "12B", "--step-time", "2.381", "--json", "--link"]
    plans = []
    for spelling in ("0.5", "500mbit", "500Mbps", "0.5Gbps"):
        assert cli_main([*argv, spelling]) == 0
        plans.append(json.loads(capsys.readouterr().out))
    assert plans[0]["link_gbps"] == pytest.approx(0.5)
    assert all(p == plans[0] for p in plans)

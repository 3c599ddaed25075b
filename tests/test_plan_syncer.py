"""The planner's syncer section: the arithmetic by hand, more load never needs fewer shards,
the measured costs against the capacity benchmark's rows, and ``diloco plan`` printing it."""

from __future__ import annotations

import doctest
import importlib
import json
from dataclasses import replace

import pytest

from diloco.cli import main as cli_main
from diloco.plan import PlanInputs, plan, syncer_exchange, with_comms
from diloco.plan.syncer import (
    RESOURCES,
    SYNCER_BYTES_PER_PARAM,
    Exchange,
    SyncerCosts,
    SyncerPlanInputs,
    codec_for_bits,
    commit_cpu_s_per_value,
    durable_bytes_per_value,
    shard_load,
    shards_needed,
)
from diloco.wire.comms import COMMS

pytestmark = pytest.mark.timeout(60)

ROUND = SyncerCosts(
    codec_cpu_ms_per_25m={"int4": (25.0, 50.0)},  # encode 1 ns/value, decode 2 ns/value
    merge_s_per_value_per_contribution=1e-9,
    outer_s_per_value=3e-9,
    persist_s_per_byte=1e-9,
    wire_s_per_byte=0.0,
    journal_bytes_per_upload_byte=1.0,
    snapshot_bytes_per_value=12.0,
    held_bytes_per_param=10.0,
    decoded_bytes_per_value=4.0,
)
"""Round costs, so the arithmetic can be checked by hand."""
U = 0.53125
"""int4's bytes per value (a 4-bit value and a float32 scale per 128)."""
SMALL = Exchange(
    params=24e6,  # 24 fragments of 1M values
    num_fragments=24,
    sync_every=2,
    step_time_s=0.5,  # the whole model: 24 / (2 · 0.5) = 24 commits/s
    learners=2,
    up_codec="int4",
    down_codec="int4",
    commits_per_snapshot=4,
)


def machine(**kw) -> SyncerPlanInputs:
    return SyncerPlanInputs(**kw)


def test_one_process_by_hand():
    # durable per value: M·u (the journal) + 12/K (the snapshot) = 2·0.53125 + 3
    assert durable_bytes_per_value(SMALL, ROUND) == pytest.approx(2 * U + 3)
    # CPU per value: M·(decode 2 + merge 1) + outer 3 + encode 1 + durable · 1 ns
    per_value = 2 * (2 + 1) + 3 + 1 + (2 * U + 3)
    assert commit_cpu_s_per_value(SMALL, ROUND) == pytest.approx(per_value * 1e-9)
    load = shard_load(SMALL, 1, ROUND)
    assert (load.fragments, load.commits_per_s) == (24, pytest.approx(24.0))
    assert load.cores == pytest.approx(24 * 1e6 * per_value * 1e-9)  # 0.3375
    # every value held at 10 B, one round of M uploads decoded (4 B) and compressed (u)
    assert load.memory_bytes == pytest.approx(24e6 * 10 + 2 * 1e6 * (4 + U))
    assert load.disk_bytes_per_s == pytest.approx(24e6 * (2 * U + 3))
    # each commit: M uploads in, its delta to M learners out, in bits
    assert load.network_in_bps == pytest.approx(8 * 24e6 * 2 * U)
    assert load.network_out_bps == load.network_in_bps


def test_the_busiest_shard_serves_the_ceiling_of_p_over_s():
    five = shard_load(SMALL, 5, ROUND)  # fragments p mod 5: shard 0 serves 5 of the 24
    assert (five.fragments, five.commits_per_s) == (5, pytest.approx(5.0))
    assert five.cores == pytest.approx(shard_load(SMALL, 1, ROUND).cores * 5 / 24)
    # the round in flight is a fragment's, whatever S
    assert five.memory_bytes == pytest.approx(5e6 * 10 + 2 * 1e6 * (4 + U))
    with pytest.raises(ValueError, match="shards must be in"):
        shard_load(SMALL, 25, ROUND)


def test_the_fewest_shards_that_fit_and_what_binds():
    # cores: 0.3375 · ⌈24/S⌉/24 ≤ 0.1 first at S = 4 (6 fragments: 0.084; S = 3: 0.1125)
    out = shards_needed(SMALL, machine(syncer_cores=0.1), ROUND)
    assert out["shards"] == 4 and out["binds"] == "cores"
    assert out["shards_per_resource"] == {"cores": 4, "memory": 1, "disk": 1, "network": 1}
    assert out["commits_per_s"] == pytest.approx(24.0)
    assert out["durable_bytes_per_commit"] == pytest.approx(1e6 * (2 * U + 3))
    assert out["per_shard"]["fragments"] == 6 and out["whole"]["fragments"] == 24
    # memory: a shard holds 10 B/value of its ⌈24/S⌉ fragments (10 MB each) beside one round
    # of M uploads (2 · 1M · (4 + u) = 9.0625 MB)
    assert shards_needed(SMALL, machine(syncer_memory=30_000_000), ROUND)["shards"] == 12
    one_each = shards_needed(SMALL, machine(syncer_memory=19_100_000), ROUND)
    assert one_each["shards"] == 24 and one_each["binds"] == "memory"
    small = shards_needed(SMALL, machine(syncer_memory=19_000_000), ROUND)  # not even one
    assert small["shards"] is None and small["binds"] == "memory"
    assert small["shards_per_resource"]["memory"] is None
    # disk: 97.5 MB/s in all; 10 MB/s per shard fits at ⌈24/S⌉ ≤ 2.46: S = 12
    disk = shards_needed(SMALL, machine(syncer_disk_mbps=10), ROUND)
    assert disk["shards_per_resource"]["disk"] == 12
    # network: 204 Mbit/s each way in all; 50 Mbit/s per shard: ⌈24/S⌉ ≤ 5.88, S = 5
    net = shards_needed(SMALL, machine(syncer_network=50e6), ROUND)
    assert net["shards_per_resource"]["network"] == 5 and net["binds"] == "network"
    # both need more than one: S = 5 is what network needs, where cores use 0.3375 · 5/24
    # of 0.1 (70%) and network 204 · 5/24 of 50 Mbit/s (85%): network binds
    tie = shards_needed(SMALL, machine(syncer_cores=0.1, syncer_network=50e6), ROUND)
    assert tie["shards"] == 5 and tie["binds"] == "network"
    assert tie["per_shard_use"]["cores"] == pytest.approx(0.3375 * 5 / 24 / 0.1)
    assert tie["per_shard_use"]["network"] == pytest.approx(8 * 24e6 * 2 * U * 5 / 24 / 50e6)
    # what needs S binds, even where another resource is busier at S: cores need 12 shards
    # (2 fragments: 70% of 0.3375 · 2/24; 3 fragments: 105%), memory 8 (3 fragments fill
    # 39.1 MB), and at S = 12 memory holds 29.06 of 39.1 MB (74%)
    forced = machine(syncer_memory=39_100_000, syncer_cores=0.3375 * 2 / 24 / 0.7)
    out = shards_needed(SMALL, forced, ROUND)
    assert out["shards_per_resource"]["cores"] == 12 and out["shards_per_resource"]["memory"] == 8
    assert out["binds"] == "cores"
    assert out["per_shard_use"]["memory"] > out["per_shard_use"]["cores"]


def need(x: Exchange, m: SyncerPlanInputs) -> dict[str, float]:
    """Shards per resource and overall, with none fitting as infinitely many."""
    out = shards_needed(x, m)
    counts = {r: float("inf") if s is None else s for r, s in out["shards_per_resource"].items()}
    return {**counts, "all": float("inf") if out["shards"] is None else out["shards"]}


MACHINES = [
    machine(),
    machine(syncer_cores=0.5, syncer_memory=2**30, syncer_disk_mbps=20, syncer_network=1e8),
    machine(syncer_cores=16, syncer_memory=2**40, syncer_disk_mbps=3000),
]


@pytest.mark.parametrize("every", [8, 0], ids=["K=8", "by-bytes"])
@pytest.mark.parametrize("m", MACHINES, ids=["reference", "small", "large"])
@pytest.mark.parametrize("comms", sorted(COMMS))
def test_more_params_more_learners_or_faster_steps_never_need_fewer_shards(m, comms, every):
    setting = COMMS[comms]
    base = Exchange(
        params=1e8,
        num_fragments=24,
        sync_every=setting.sync_every,
        step_time_s=1.0,
        learners=4,
        up_codec=setting.up_codec,
        down_codec=setting.down_codec,
        commits_per_snapshot=every,
    )
    ladders = {
        "params": [1e7, 1e8, 3.5e8, 1e9, 7e9, 7e10],
        "learners": [1, 2, 4, 8, 16, 64],
        "step_time_s": [4.0, 1.0, 0.5, 0.1, 0.01],  # faster and faster
    }
    for name, values in ladders.items():
        needs = [need(replace(base, **{name: v}), m) for v in values]
        for before, after in zip(needs, needs[1:], strict=False):
            for key in (*RESOURCES, "all"):
                assert after[key] >= before[key], (comms, name, key, before, after)
    grown = need(replace(base, params=7e10, learners=64, step_time_s=0.01), m)
    assert grown["all"] >= need(base, m)["all"]


def capacity_row_cores(accepted: float, commits: float) -> float:
    """The cores the measured costs give one row of RESULTS "Syncer capacity" (100M
    parameters, P = H = 24, int4 up, int8 down; each commit journalled, a snapshot every 8
    commits of a fragment)."""
    x = Exchange(
        params=100e6,
        num_fragments=24,
        sync_every=24,
        step_time_s=0.5,
        learners=accepted / commits,  # uploads merged per commit
        up_codec="int4",
        down_codec="int8",
        commits_per_snapshot=8,
    )
    return commits * 100e6 / 24 * commit_cpu_s_per_value(x, SyncerCosts())


@pytest.mark.parametrize(
    "accepted, commits, measured",
    [(31.8, 2.00, 0.876), (43.2, 1.80, 1.038), (37.8, 1.15, 1.004)],
    ids=["M=16", "M=24", "M=32"],
)
def test_the_measured_costs_give_the_capacity_benchmarks_cores(accepted, commits, measured):
    """RESULTS "Syncer capacity" (2026-11-29): the syncer process's CPU in the three rows the
    wire's cost was fitted to (least squares), each within 10%."""
    assert capacity_row_cores(accepted, commits) == pytest.approx(measured, rel=0.1)


def test_the_plans_bits_name_the_codecs_the_syncer_runs():
    for name, setting in COMMS.items():
        x = syncer_exchange(with_comms(PlanInputs(params=1e9, step_time_s=1.0), name))
        assert (x.up_codec, x.down_codec, x.sync_every) == (
            setting.up_codec,
            setting.down_codec,
            setting.sync_every,
        )
    assert codec_for_bits(4) == "int4" and codec_for_bits(8) == "int8"
    assert codec_for_bits(32) == "fp32"
    paper = syncer_exchange(PlanInputs(params=1e9, step_time_s=1.0, sites=5))
    assert (paper.up_codec, paper.down_codec, paper.learners) == ("int4", "int4", 5)


def test_syncer_inputs_are_validated():
    for kw in (
        {"learners": 0},
        {"syncer_cores": 0.0},
        {"syncer_memory": 0},
        {"syncer_disk_mbps": -1.0},
        {"syncer_network": 0.0},
        {"commits_per_snapshot": -1},
    ):
        with pytest.raises(ValueError):
            SyncerPlanInputs(**kw)


def test_a_billion_parameters_at_todays_default(capsys):
    """The issue's case: 1B, M = 4, 1 s steps, --comms default on reference machines."""
    argv = ["plan", "--params", "1B", "--learners", "4", "--step-time", "1.0", "--comms"]
    assert cli_main([*argv, "default", "--json"]) == 0
    section = json.loads(capsys.readouterr().out)["syncer"]
    assert section["commits_per_s"] == pytest.approx(24 / 16)
    assert section["exchange"]["learners"] == 4
    # the journal's 4 sign1 uploads and a 12-byte snapshot every 8 commits, per value (by
    # bytes: once the records hold 0.4 of a snapshot, 0.4 · 12 / 0.625 → 8)
    assert section["snapshot_every"] == 8 and section["exchange"]["commits_per_snapshot"] == 0
    assert section["durable_bytes_per_commit"] == pytest.approx(1e9 / 24 * (4 * 0.15625 + 1.5))
    assert cli_main([*argv[:4], "1", *argv[5:], "default", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)["syncer"]  # one learner: 0.4 · 12 / 0.156 → 31
    assert alone["snapshot_every"] == 31
    assert alone["durable_bytes_per_commit"] == pytest.approx(1e9 / 24 * (0.15625 + 12 / 31))
    assert alone["durable_bytes_per_commit"] <= 4 * 1e9 / 24 * 0.15625
    assert section["whole"]["memory_bytes"] > 1e9 * SYNCER_BYTES_PER_PARAM
    assert section["shards"] == max(section["shards_per_resource"].values()) >= 2
    assert section["shards_per_resource"]["memory"] == 1  # 14.7 GB: within 24 GiB
    assert section["binds"] == max(section["per_shard_use"], key=section["per_shard_use"].get)


def test_the_cli_prints_the_syncer_section(capsys):
    argv = ["plan", "--params", "1B", "--learners", "4", "--step-time", "1.0"]
    machine_flags = ["--syncer-cores", "2", "--syncer-memory", "24GiB"]
    assert cli_main([*argv, *machine_flags, "--syncer-disk-mbps", "300"]) == 0
    out = capsys.readouterr().out
    assert "syncer (M=4 learners, int4 up / int4 down, P=24, H=24" in out
    assert "shards needed: " in out and "of 300 MB/s" in out
    assert "of 1 core (one process's, of 2)" in out  # (one interpreter lock: PROCESS_CORES)
    assert "2-core reference machine" in out and "scales with your cores" in out
    assert cli_main([*argv, "--syncer-cores", "2", "--json"]) == 0
    on_two = json.loads(capsys.readouterr().out)["syncer"]
    assert cli_main([*argv, "--syncer-memory", "512GiB", "--syncer-cores", "64", "--json"]) == 0
    section = json.loads(capsys.readouterr().out)["syncer"]
    assert section["machine"]["syncer_memory"] == 512 * 2**30
    # one process keeps one core busy however many its machine has (PROCESS_CORES)
    assert section["shards"] == on_two["shards"] and section["binds"] == "cores"
    assert cli_main([*argv, "--syncer-memory", "1MiB"]) == 0
    assert "shards needed: none of 1..24 fits" in capsys.readouterr().out
    assert cli_main([*argv, "--learners", "0"]) == 2
    assert "learners must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main([*argv, "--syncer-memory", "lots"])
    assert "not a size" in capsys.readouterr().err


def test_the_plan_carries_the_section_for_any_inputs():
    out = plan(PlanInputs(params=12e9, step_time_s=2.381))
    assert out["syncer"]["exchange"]["learners"] == 8  # one per site
    assert out["inputs"]["syncer"]["learners"] is None


@pytest.mark.parametrize("module", ["diloco.plan", "diloco.plan.syncer"])
def test_doctests(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0

"""``diloco bench``: the matrix, the table and the targets, and a bounded end-to-end smoke run."""

from __future__ import annotations

import json
import subprocess

import pytest
from kit import diloco_command

from diloco.bench import matrix as mx
from diloco.report import bench as rp


def test_the_matrix_gives_every_mode_the_same_recipe_seed_and_budget():
    budget = mx.Budget(learners=4, steps=800, minutes=4)
    runs = mx.matrix(["decoupled", "sync", "dp"], ["clean", "chaos", "slow"], [0, 1], budget)
    assert len(runs) == 18 and len({r.name for r in runs}) == 18
    for condition in ("clean", "chaos", "slow"):
        cell = [r for r in runs if r.condition == condition and r.seed == 1]
        stripped = {tuple(f for f in r.flags if not f.startswith("--mode")) for r in cell}
        assert len(stripped) == 1  # identical but for the mode
    clean = next(r for r in runs if r.condition == "clean")
    assert "--steps=800" in clean.flags and "--learners=4" in clean.flags
    chaos = next(r for r in runs if r.condition == "chaos")
    assert f"--chaos={mx.DEFAULT_CHAOS}" in chaos.flags
    slow = next(r for r in runs if r.condition == "slow")
    assert "--slow=1=3.0" in slow.flags
    with_peer = mx.matrix(["decoupled"], ["clean", "chaos"], [0], budget, peers=["torchft"])
    assert [r.name for r in with_peer] == [
        "decoupled-clean-s0",
        "torchft-clean-s0",
        "decoupled-chaos-s0",
    ]
    with pytest.raises(ValueError, match="unknown mode"):
        mx.matrix(["ring"], ["clean"], [0], budget)
    with pytest.raises(ValueError, match="unknown peer"):
        mx.matrix(["dp"], ["clean"], [0], budget, peers=["horovod"])
    sweep = mx.sweep(budget, seed=0)
    grid, extra = sweep[:9], sweep[9:]
    assert {r.sweep["H"] for r in grid} == {24, 48, 96}
    assert {(r.mode, r.sweep["down_codec"]) for r in grid} == {("decoupled", "int8")}
    assert [(r.mode, *r.sweep.values()) for r in extra] == [
        (mode, *setting) for mode, *setting in mx.LOW_BANDWIDTH
    ]
    for r in sweep:
        s = r.sweep
        assert f"--mode={r.mode}" in r.flags and f"--sync-every={s['H']}" in r.flags
        assert f"--up-codec={s['up_codec']}" in r.flags
        assert f"--down-codec={s['down_codec']}" in r.flags
    assert len({r.name for r in sweep}) == len(sweep)
    # a subset of settings, e.g. to repeat the ones a target rests on with more seeds
    only = [mx.parse_setting("sync:96:int4:int4"), mx.parse_setting("decoupled:24:int4:bf16")]
    assert only == [("sync", 96, "int4", "int4"), ("decoupled", 24, "int4", "bf16")]
    names = [r.name for s in (1, 2) for r in mx.sweep(budget, seed=s, only=only)]
    assert names == [
        "sweep-sync-H96-int4-int4-s1",
        "sweep-H24-int4-s1",
        "sweep-sync-H96-int4-int4-s2",
        "sweep-H24-int4-s2",
    ]
    for bad in ("dp:24:int4:bf16", "sync:0:int4:int4", "sync:96:int4", "sync:x:int4:int4"):
        with pytest.raises(ValueError):
            mx.parse_setting(bad)


def fake_result(
    mode, condition, seed, loss, tokens=1000, wall=10.0, goodput=0.9, bpt=10.0, down=None
):
    summary = {
        "down_share": down,
        "goodput_up": None if down is None else goodput / (1 - down),
        "val_loss": {"initial": 5.5, "final": loss},
        "tokens": tokens,
        "wall_s": wall,
        "goodput": goodput,
        "bytes": {"per_token": bpt, "data_parallel_per_token": 3000.0},
    }
    return rp.result_of({"mode": mode, "condition": condition, "seed": seed}, summary, [])


def test_cells_take_medians_over_seeds_and_targets_compare_them():
    results = [fake_result("decoupled", "clean", s, loss) for s, loss in enumerate((2.0, 2.2, 2.1))]
    results += [fake_result("sync", "clean", s, 2.05) for s in range(3)]
    results += [fake_result("dp", "clean", s, 1.9, bpt=3000.0) for s in range(3)]
    results += [fake_result("decoupled", "chaos", 0, 2.3, goodput=0.92, down=0.05)]
    results += [fake_result("dp", "chaos", 0, 2.9, goodput=0.3)]
    results += [fake_result("decoupled", "slow", 0, 2.3, tokens=3000)]
    results += [fake_result("sync", "slow", 0, 2.3, tokens=1500)]
    rows = rp.cells(results)
    dec = rp.find(rows, mode="decoupled", condition="clean")
    assert dec["val_loss"] == pytest.approx(2.1) and dec["seeds"] == [0, 1, 2]
    assert dec["tokens_per_s"] == pytest.approx(100.0)  # tokens over wall seconds
    goals = {g["target"]: g for g in rp.targets(rows)}
    assert goals["clean: decoupled within 2% of sync DiLoCo"]["met"] is False  # +2.4%
    assert goals["clean: DiLoCo family's gap to data-parallel below +14%"]["met"] is True
    chaos_goal = goals["chaos: decoupled goodput >= 90% and above dp and sync"]
    assert chaos_goal["met"] is True
    assert "down time: 5.0% of provisioned" in chaos_goal["measured"]
    chaos_row = rp.find(rows, mode="decoupled", condition="chaos")
    assert chaos_row["goodput_up"] == pytest.approx(0.92 / 0.95)
    assert goals["slow: decoupled tokens/s >= 1.5x sync's"]["measured"] == "2.00x"
    table = rp.markdown_table(rows)
    assert table.count("\n") == 1 + len(rows) and "| decoupled | clean | 3 | 2.100 |" in table


def test_the_bandwidth_target_needs_both_the_ratio_and_the_quality():
    def row(mode, h, up, down, loss, bpt):
        return {"mode": mode, "H": h, "up_codec": up, "down_codec": down, "val_loss": loss,
                "bytes_per_token": bpt}  # fmt: skip

    rows = [
        row("decoupled", 24, "int4", "int8", 2.00, 30.0),
        row("decoupled", 96, "int4", "int8", 2.08, 10.0),
        row("decoupled", 96, "fp32", "int8", 2.30, 5.0),
        row("sync", 24, "int4", "int8", 1.90, 29.0),  # better, but not the default setting
    ]
    goal = rp.bandwidth_target(rows, dp_bytes_per_token=3000.0)
    assert goal["met"] is True and goal["measured"].startswith("300x at decoupled H=96 int4/int8")
    rows[1]["val_loss"] = 2.2  # now too far from H=24
    assert rp.bandwidth_target(rows, dp_bytes_per_token=3000.0)["met"] is False


def test_the_sweep_figure_and_table_name_every_setting(tmp_path):
    from diloco.report import plots

    rows = [
        {"mode": m, "H": h, "up_codec": "int4", "down_codec": d, "val_loss": loss,
         "bytes_per_token": bpt, "seeds": [0], "tokens": 1, "tokens_per_s": 1.0,
         "goodput": 0.9, "wall_s": 1.0}
        for m, h, d, loss, bpt in [("decoupled", 24, "bf16", 2.0, 200.0),
                                    ("sync", 96, "int4", 2.1, 12.0)]
    ]  # fmt: skip
    assert plots.sweep_tradeoff(rows, tmp_path).stat().st_size > 5000
    table = rp.markdown_table(rows, mx.SWEEP_KEYS)
    assert "| sync | 96 | int4 | int4 | 1 | 2.100 |" in table


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_tiny_bench_runs_writes_its_table_and_figures_and_resumes(tmp_path):
    argv = diloco_command(
        "bench",
        f"--out={tmp_path}",
        "--modes=decoupled,dp",
        "--conditions=clean",
        "--seeds=0",
        "--recipe=tiny",
        "--learners=2",
        "--steps=40",
        "--eval-every=2",
    )
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [r["mode"] for r in results] == ["decoupled", "dp"]
    for r in results:
        assert r["tokens"] == 2 * 40 * 8 * 32  # equal tokens: M x steps x batch x context
        assert r["val_loss"] < r["val_loss_initial"] and r["curve"]
    table = (tmp_path / "table.md").read_text()
    assert "| dp | clean | 1 |" in table and "Targets:" in table
    for name in ("loss_vs_tokens", "loss_vs_time", "bytes_per_token", "tokens_per_s"):
        assert (tmp_path / f"{name}.png").stat().st_size > 5000
    again = subprocess.run(argv, capture_output=True, text=True, timeout=60)  # nothing to rerun
    assert again.returncode == 0 and again.stdout.count("tokens") >= 2


def test_the_peer_trains_the_same_cell_budget():
    from diloco.baselines.torchft.bench_peer import peer_kwargs

    budget = mx.Budget(learners=4, steps=800, minutes=4, recipe="shakespeare")
    clean, slow = mx.matrix(["dp"], ["clean", "slow"], [3], budget, peers=["torchft"])[1::2]
    kw = peer_kwargs(clean, budget)
    assert kw["tokens"] == 4 * 800 * 8 * 128 and kw["learners"] == 4 and kw["seed"] == 3
    kw = peer_kwargs(slow, budget)
    assert kw["minutes"] == 4 and kw["slow"] == {1: 3.0}
    chaos = mx.RunSpec("torchft-chaos-s0", "torchft", "chaos", 0, (), peer="torchft")
    with pytest.raises(ValueError, match="no 'chaos' condition"):
        peer_kwargs(chaos, budget)

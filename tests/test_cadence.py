"""The checkpoint clock (diloco.runtime.cadence): pure, no files, no sleeps."""

import argparse
import math

import pytest

from diloco.runtime.cadence import AUTO, CheckpointCadence, auto_interval, parse_every

KW = {"budget": 0.01, "floor_s": 1.0, "cap_s": 300.0}


def test_auto_interval_spends_the_budget_on_saving():
    assert auto_interval(0.018, **KW) == pytest.approx(1.8)  # the default recipe's 10 MB
    assert auto_interval(0.5, **KW) == pytest.approx(50.0)
    assert auto_interval(0.0, **KW) == 1.0  # never more often than the floor
    assert auto_interval(10.0, **KW) == 300.0  # never longer than the cap
    with pytest.raises(ValueError):
        auto_interval(0.1, budget=0.0, floor_s=1.0, cap_s=300.0)
    with pytest.raises(ValueError):
        auto_interval(-0.1, **KW)


def test_parse_every():
    assert parse_every("auto") == AUTO
    assert parse_every(" AUTO ") == AUTO
    assert parse_every("2.5") == 2.5
    assert parse_every("0") == 0.0
    for bad in ("-1", "nan", "soon", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_every(bad)


def test_auto_cadence_follows_the_measured_save_time():
    c = CheckpointCadence(every=AUTO, start=100.0)
    assert c.interval == 1.0  # nothing measured yet: the floor
    assert not c.due(100.9)
    assert c.due(101.0)
    c.saved(101.0, cost_s=0.05)  # 50 ms per save -> every 5 s
    assert c.interval == pytest.approx(5.0)
    assert not c.due(105.9)
    assert c.due(106.0)
    c.saved(106.0, cost_s=0.15)  # EMA with decay 0.5: 0.1 s -> every 10 s
    assert c.save_s == pytest.approx(0.1)
    assert c.interval == pytest.approx(10.0)


def test_fixed_and_exit_only_cadences():
    c = CheckpointCadence(every=2.0, start=0.0)
    assert not c.due(1.99) and c.due(2.0)
    c.saved(2.0, cost_s=30.0)  # a slow save does not move a fixed interval
    assert c.interval == 2.0 and c.due(4.0)
    never = CheckpointCadence(every=0.0, start=0.0)
    assert math.isinf(never.interval) and not never.due(1e9)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"every": -1.0},
        {"every": "hourly"},
        {"every": AUTO, "decay": 0.0},
        {"every": AUTO, "floor_s": 0.0},
        {"every": AUTO, "floor_s": 10.0, "cap_s": 5.0},
        {"every": AUTO, "budget": 1.5},
    ],
)
def test_bad_cadence_is_refused(kwargs):
    with pytest.raises(ValueError):
        CheckpointCadence(start=0.0, **kwargs)

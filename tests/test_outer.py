"""Outer Nesterov optimizer: a worked vector and golden numbers for a few steps."""

from __future__ import annotations

import pytest
import torch

from diloco.algorithm import NesterovOuter, round_share
from diloco.algorithm.outer import scheduled_outer_lr


def test_worked_vector_one_step():
    outer = NesterovOuter(lr=0.7, momentum=0.9)
    theta = torch.zeros(1)
    outer.step(0, theta, torch.tensor([0.5]))
    assert float(theta) == pytest.approx(-0.665)


def test_golden_three_steps():
    # m1 = 0.5 -> Θ -= 0.7*(0.5+0.45) = 0.665           Θ = -0.665
    # m2 = 0.45+0.2 = 0.65 -> Θ -= 0.7*(0.2+0.585)=0.5495 Θ = -1.2145
    # m3 = 0.585-0.1 = 0.485 -> Θ -= 0.7*(-0.1+0.4365)   Θ = -1.45005
    outer = NesterovOuter(lr=0.7, momentum=0.9)
    theta = torch.zeros(1, dtype=torch.float64)
    for delta, expected in [(0.5, -0.665), (0.2, -1.2145), (-0.1, -1.45005)]:
        outer.step(3, theta, torch.tensor([delta], dtype=torch.float64))
        assert float(theta) == pytest.approx(expected, abs=1e-6)


def test_plain_averaging_default():
    outer = NesterovOuter()
    theta = torch.tensor([1.0, 2.0])
    outer.step(0, theta, torch.tensor([0.5, -1.0]))
    assert theta.tolist() == [0.5, 3.0]
    assert outer.fragment_state(0) == {}


def test_fragments_are_independent_and_state_round_trips():
    outer = NesterovOuter(lr=0.5, momentum=0.9)
    a, b = torch.zeros(2), torch.zeros(2)
    outer.step(0, a, torch.ones(2))
    outer.step(1, b, -torch.ones(2))
    clone = NesterovOuter(lr=0.1, momentum=0.1)
    clone.load_state_dict(outer.state_dict())
    a2 = a.clone()
    outer.step(0, a, torch.ones(2))
    clone.step(0, a2, torch.ones(2))
    assert torch.equal(a, a2)
    assert torch.equal(outer.fragment_state(1)["momentum"], -torch.ones(2))
    fresh = NesterovOuter(lr=0.5, momentum=0.9)
    fresh.load_fragment_state(1, outer.fragment_state(1))
    assert torch.equal(fresh.fragment_state(1)["momentum"], -torch.ones(2))


@pytest.mark.parametrize("lr,mu", [(0.0, 0.0), (-1.0, 0.0), (1.0, 1.0), (1.0, -0.1)])
def test_bad_hyperparameters(lr, mu):
    with pytest.raises(ValueError):
        NesterovOuter(lr=lr, momentum=mu)


def test_round_share():
    assert round_share([100], [100, 100, 100]) == pytest.approx(0.25)
    assert round_share([100, 300], []) == 1.0
    assert round_share([100], [None]) == pytest.approx(0.5)  # unknown: the round's mean
    assert round_share([50, 150], [None, 200]) == pytest.approx(200 / 500)
    # over one cycle of M single-learner rounds the shares add up to one full step
    tokens = [10, 20, 30, 40]
    total = sum(round_share([t], tokens[:i] + tokens[i + 1 :]) for i, t in enumerate(tokens))
    assert total == pytest.approx(1.0)
    with pytest.raises(ValueError):
        round_share([], [1])
    with pytest.raises(ValueError):
        round_share([0], [1])
    with pytest.raises(ValueError):
        round_share([1], [-1])


def test_scheduled_outer_lr_decays_by_cosine_then_holds():
    lrs = [scheduled_outer_lr(v, lr=1.0, decay_versions=2, final=0.2) for v in range(4)]
    assert lrs == pytest.approx([1.0, 0.6, 0.2, 0.2])
    assert scheduled_outer_lr(5, lr=0.6, decay_versions=0, final=0.2) == 0.6


@pytest.mark.parametrize(
    "version, decay, final", [(-1, 2, 0.5), (0, -1, 0.5), (0, 2, 0.0), (0, 2, 1.5)]
)
def test_scheduled_outer_lr_refuses_bad_input(version, decay, final):
    with pytest.raises(ValueError):
        scheduled_outer_lr(version, lr=1.0, decay_versions=decay, final=final)


def test_step_takes_a_scheduled_lr():
    outer = NesterovOuter(lr=0.7, momentum=0.9)
    theta = torch.zeros(1)
    outer.step(0, theta, torch.tensor([0.5]), lr=0.35)  # half the design vector's step
    assert float(theta) == pytest.approx(-0.3325)
    with pytest.raises(ValueError):
        outer.step(0, theta, torch.tensor([0.5]), lr=0.0)

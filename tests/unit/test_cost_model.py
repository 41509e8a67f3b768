"""The step-time cost model recovers known coefficients from synthetic timings and follows drift online."""

from __future__ import annotations

import numpy as np
import pytest

from actors.spec.cost_model import ForwardShape, LinearCost, StepCostModel, nnls


def synthetic(rng: np.random.Generator, weights: list[float], n: int, intercept: bool,
              noise: float = 0.02) -> list[tuple[ForwardShape, float]]:
    """n random batch shapes and their times under `weights`, with multiplicative noise."""
    points = []
    for _ in range(n):
        forwards = int(rng.integers(1, 6))
        tokens = int(rng.integers(1, 300))
        shape = ForwardShape(forwards, tokens, tokens * float(rng.integers(1, 1000)) / 1024)
        seconds = float(np.dot(weights, shape.features(intercept))) * (1 + noise * rng.standard_normal())
        points.append((shape, seconds))
    return points


@pytest.mark.parametrize("intercept", [True, False])
def test_the_fit_recovers_the_coefficients_of_synthetic_timings(intercept: bool) -> None:
    rng = np.random.default_rng(0)
    true = [0.030, 0.0012, 0.0004]
    model = LinearCost(intercept=intercept)
    for shape, seconds in synthetic(rng, true, 200, intercept):
        model.observe(shape, seconds)
    model.fit()

    np.testing.assert_allclose(model.weights, true, rtol=0.1)
    probe = ForwardShape(2, 100, 50.0)
    assert model.predict(probe) == pytest.approx(float(np.dot(true, probe.features(intercept))), rel=0.05)


def test_coefficients_stay_non_negative_when_the_truth_has_a_zero() -> None:
    rng = np.random.default_rng(1)
    true = [0.05, 0.002, 0.0]  # no attention cost: unconstrained least squares would go slightly negative
    model = LinearCost(intercept=True)
    for shape, seconds in synthetic(rng, true, 100, True, noise=0.1):
        model.observe(shape, seconds)
    model.fit()

    assert (model.weights >= 0).all()
    assert model.weights[2] < 1e-4
    np.testing.assert_allclose(model.weights[:2], true[:2], rtol=0.15)


def test_nnls_matches_the_exact_solution_when_it_is_feasible() -> None:
    x = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    y = x @ np.array([2.0, 3.0])
    np.testing.assert_allclose(nnls(x, y), [2.0, 3.0], atol=1e-6)
    np.testing.assert_allclose(nnls(x, -y), [0.0, 0.0])  # infeasible direction: clamps to zero


def test_the_online_window_follows_a_change_of_machine_speed() -> None:
    rng = np.random.default_rng(2)
    model = LinearCost(intercept=True, window=64, refit_every=8)
    for shape, seconds in synthetic(rng, [0.02, 0.001, 0.0], 64, True):
        model.observe(shape, seconds)
    slow = [0.04, 0.003, 0.0]  # the machine got busier: everything costs more
    for shape, seconds in synthetic(rng, slow, 64, True):
        model.observe(shape, seconds)

    probe = ForwardShape(1, 50, 0.0)
    assert model.predict(probe) == pytest.approx(0.04 + 50 * 0.003, rel=0.1)


def test_pinned_calibration_points_never_slide_out() -> None:
    model = LinearCost(intercept=True, window=4, refit_every=1)
    for tokens in (1, 100):
        model.observe(ForwardShape(1, tokens), 0.01 + 0.001 * tokens, pinned=True)
    for _ in range(50):  # many identical recent points say nothing about the slope
        model.observe(ForwardShape(1, 10), 0.02)

    assert model.num_observations == 6
    assert model.weights[1] == pytest.approx(0.001, rel=0.2)


def test_the_step_model_adds_the_draft_only_when_it_runs() -> None:
    model = StepCostModel.from_weights(target=[0.1, 0.01, 0.0], draft=[0.02, 0.001, 0.0])
    target = ForwardShape(1, 10)
    assert model.predict(target, ForwardShape()) == pytest.approx(0.2)
    assert model.predict(target, ForwardShape(3, 6)) == pytest.approx(0.2 + 0.06 + 0.006)

"""The step-time cost model recovers known coefficients from synthetic timings and follows drift online."""

from __future__ import annotations

import numpy as np
import pytest

from actors.speculation.cost_model import ForwardShape, LinearCost, StepCostModel, nnls


def synthetic(rng: np.random.Generator, weights: list[float], n: int, several_forwards: bool,
              noise: float = 0.02) -> list[tuple[ForwardShape, float]]:
    """n random batch shapes and their times under linear `weights` [per forward, per token, per attention
    unit], with multiplicative noise."""
    points = []
    for _ in range(n):
        forwards = int(rng.integers(1, 6)) if several_forwards else 1
        tokens = int(rng.integers(1, 300))
        shape = ForwardShape(forwards, tokens, tokens * float(rng.integers(1, 1000)) / 1024)
        seconds = float(np.dot(weights, shape.features(knots=()))) * (1 + noise * rng.standard_normal())
        points.append((shape, seconds))
    return points


@pytest.mark.parametrize("several_forwards", [True, False])
def test_the_fit_recovers_the_coefficients_of_synthetic_timings(several_forwards: bool) -> None:
    rng = np.random.default_rng(0)
    true = [0.030, 0.0012, 0.0004]
    model = LinearCost(knots=())
    for shape, seconds in synthetic(rng, true, 200, several_forwards):
        model.observe(shape, seconds)
    model.fit()

    np.testing.assert_allclose(model.weights, true, rtol=0.1)
    probe = ForwardShape(2, 100, 50.0)
    assert model.predict(probe) == pytest.approx(float(np.dot(true, probe.features(knots=()))), rel=0.05)


def test_coefficients_stay_non_negative_when_the_truth_has_a_zero() -> None:
    rng = np.random.default_rng(1)
    true = [0.05, 0.002, 0.0]  # no attention cost: unconstrained least squares would go slightly negative
    model = LinearCost(knots=())
    for shape, seconds in synthetic(rng, true, 100, False, noise=0.1):
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
    model = LinearCost(knots=(), window=64, refit_every=8)
    for shape, seconds in synthetic(rng, [0.02, 0.001, 0.0], 64, False):
        model.observe(shape, seconds)
    slow = [0.04, 0.003, 0.0]  # the machine got busier: everything costs more
    for shape, seconds in synthetic(rng, slow, 64, False):
        model.observe(shape, seconds)

    probe = ForwardShape(1, 50, 0.0)
    assert model.predict(probe) == pytest.approx(0.04 + 50 * 0.003, rel=0.1)


def test_pinned_calibration_points_never_slide_out() -> None:
    model = LinearCost(knots=(), window=4, refit_every=1)
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


# Per-forward times (s) by tokens fed, measured on this machine for Qwen2.5-Coder-1.5B in fp32 (MKL on an
# AMD EPYC, rounded: one token takes a fast path, 3 to 16 cost about the same), and a GPU-like curve (flat, then compute-bound).
CPU_CURVE = {1: 0.435, 2: 1.06, 4: 1.24, 5: 1.26, 8: 1.38, 16: 1.68, 32: 2.3, 64: 3.5, 128: 6.1}
GPU_CURVE = {n: 0.012 + 0.0003 * max(0, n - 48) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}


@pytest.mark.parametrize("curve", [CPU_CURVE, GPU_CURVE], ids=["cpu", "gpu"])
def test_the_piecewise_basis_follows_measured_curves_a_line_cannot(curve: dict[int, float]) -> None:
    piecewise, line = LinearCost(), LinearCost(knots=())
    for n, seconds in curve.items():
        for model in (piecewise, line):
            model.observe(ForwardShape(1, n), seconds, pinned=True)

    errors = {name: max(abs(m.predict(ForwardShape(1, n)) / s - 1) for n, s in curve.items())
              for name, m in (("piecewise", piecewise), ("line", line))}
    assert errors["piecewise"] < 0.05, errors
    assert errors["line"] > 0.2, errors  # a line misses either the one-token fast path or the flat region


def test_draft_forwards_are_costed_one_by_one_from_their_sizes() -> None:
    model = LinearCost()
    for n, seconds in CPU_CURVE.items():
        model.observe(ForwardShape(1, n), seconds, pinned=True)
    two = ForwardShape(2, 9, 0.0, sizes=(8, 1))  # one forward of 8 rows and one of 1
    assert model.predict(two) == pytest.approx(CPU_CURVE[8] + CPU_CURVE[1], rel=0.05)
    assert ForwardShape(2, 8).features() == ForwardShape(2, 8, sizes=(4, 4)).features()


def test_nnls_finds_the_constrained_optimum_of_random_problems() -> None:
    rng = np.random.default_rng(3)
    for _ in range(50):
        x = rng.standard_normal((12, 4))
        y = rng.standard_normal(12)
        w = nnls(x, y, ridge=0.0)
        best = min(  # brute force over which coefficients are free
            (np.linalg.norm(x @ v - y), tuple(v))
            for mask in range(16)
            for v in [_solve_on(x, y, mask)]
            if (v >= 0).all()
        )
        assert (w >= 0).all()
        assert np.linalg.norm(x @ w - y) == pytest.approx(best[0], abs=1e-8)


def _solve_on(x: np.ndarray, y: np.ndarray, mask: int) -> np.ndarray:
    cols = [j for j in range(x.shape[1]) if mask >> j & 1]
    v = np.zeros(x.shape[1])
    if cols:
        v[cols] = np.linalg.lstsq(x[:, cols], y, rcond=None)[0]
    return v


def test_the_step_overhead_is_fitted_per_request_and_added_to_every_prediction() -> None:
    model = StepCostModel(refit_every=1)
    rng = np.random.default_rng(4)
    for _ in range(40):
        requests = int(rng.integers(1, 9))
        model.observe(ForwardShape(1, requests), 0.1 * requests, requests=requests,
                      overhead_s=0.02 + 0.005 * requests)
    target = ForwardShape(1, 4)
    assert model.predict(target, ForwardShape(), requests=4) == pytest.approx(0.4 + 0.02 + 0.02, rel=0.02)
    assert model.predict(target, ForwardShape()) == pytest.approx(0.4, rel=0.02)  # no emitting request, no overhead

"""Step-time cost model: piecewise linear in batch size per forward, fitted from measured times and re-fitted online.

SmartSpec (Liu et al., arXiv 2406.14066) models a verification step's latency as linear in the batch's
tokens. On real kernels the time of one forward is not linear in its token count n: on a GPU it is
flat until the matmuls turn compute-bound, and on this machine's CPU (MKL on AMD, measured in
docs/scheduler.md) fp32 jumps 3x from n=1 to n=3 and then stays flat to n=16. So each forward's cost
is a combination of a piecewise-linear basis in n with knots c (a concave kink is
min(n, c), a convex one max(0, n - c)), plus attention work:

  seconds = sum over forwards f of [ w0 + w1 n_f + sum_c (u_c min(n_f, c) + v_c max(0, n_f - c)) ]
            + w2 * attention

with every coefficient but w0 non-negative: slopes in n are never negative, so predicted time never
falls as a batch grows. The per-forward
term w0 alone may be negative: a curve that is steep from n=1 to n=2 and then flat (this CPU) is
concave only from n=1 on, and n=0 never occurs. We fit one model for the target's forward and one
for the draft's forwards (k_max of them per step, each over the requests still drafting). `attention`
sums new tokens x context length over requests, in units of 1024 token pairs. The coefficients are
fitted by least squares of the relative error over the calibration points plus a sliding window of
recent steps, so a model fitted on one machine follows load drift.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ATTENTION_UNIT = 1024.0
KNOTS = (2, 4, 8, 16, 32, 64, 128)  # tokens per forward where the time curve may bend


@dataclass(frozen=True)
class ForwardShape:
    """What one phase of a step processed: forwards run, tokens fed, attention work.

    `sizes` lists the tokens of each forward; left empty, the tokens are taken as spread evenly.
    """

    forwards: int = 0
    tokens: int = 0
    attention: float = 0.0  # sum over requests of new tokens x context, / ATTENTION_UNIT
    sizes: tuple[int, ...] = ()

    def per_forward(self) -> list[float]:
        """Tokens of each forward."""
        if self.sizes:
            return [float(n) for n in self.sizes]
        return [self.tokens / self.forwards] * self.forwards if self.forwards else []

    def features(self, knots: Sequence[int] = KNOTS) -> list[float]:
        """[forwards, tokens, attention, sum_f min(n_f, c) for c in knots, sum_f max(0, n_f - c) for c in knots].

        Plain Python, not NumPy: a step has a handful of forwards, and the goodput policy evaluates hundreds of
        shapes per step, where NumPy's per-call overhead cost milliseconds."""
        n = self.per_forward()
        concave = [sum(min(x, c) for x in n) for c in knots]
        convex = [sum(max(x - c, 0.0) for x in n) for c in knots]
        return [float(self.forwards), float(self.tokens), self.attention, *concave, *convex]


def nnls(x: np.ndarray, y: np.ndarray, ridge: float = 1e-9) -> np.ndarray:
    """Non-negative least squares, min |x w - y|^2 + ridge |w|^2 with w >= 0 (Lawson and Hanson's active set
    method, "Solving Least Squares Problems", 1974, ch. 23). x: (n, f), y: (n,); returns w: (f,)."""
    f = x.shape[1]
    xa = np.vstack([x, np.sqrt(ridge) * np.eye(f)])  # (n + f, f): the ridge as extra rows
    ya = np.concatenate([y, np.zeros(f)])  # (n + f,)
    tol = 1e-10 * max(1.0, float(np.abs(xa.T @ ya).max()))
    free = np.zeros(f, dtype=bool)  # the passive set: coefficients allowed to move off zero
    w = np.zeros(f)
    for _ in range(3 * f):
        grad = xa.T @ (ya - xa @ w)  # (f,) descent direction of the residual
        if free.all() or grad[~free].max() <= tol:
            break
        free[np.argmax(np.where(free, -np.inf, grad))] = True
        while True:
            z = np.zeros(f)
            z[free] = np.linalg.lstsq(xa[:, free], ya, rcond=None)[0]
            if (z[free] > 0).all():
                w = z
                break
            blocked = free & (z <= 0)  # step from w toward z only until the first coefficient hits zero
            den = w[blocked] - z[blocked]
            alpha = float(np.min(np.where(den > 0, w[blocked] / np.where(den > 0, den, 1.0), 0.0)))
            w = w + alpha * (z - w)
            free &= w > 0
            w[~free] = 0.0
    return w


class LinearCost:
    """seconds = w . features, w >= 0, fitted on pinned points plus the last `window` observations."""

    def __init__(self, knots: Sequence[int] = KNOTS, window: int = 256, refit_every: int = 16) -> None:
        self.knots = tuple(knots)
        self.refit_every = refit_every
        self._pinned: list[tuple[list[float], float]] = []
        self._recent: deque[tuple[list[float], float]] = deque(maxlen=window)
        self._since_fit = 0
        self.weights = np.zeros(3 + 2 * len(self.knots))

    @property
    def num_observations(self) -> int:
        return len(self._pinned) + len(self._recent)

    def observe(self, shape: ForwardShape, seconds: float, pinned: bool = False) -> None:
        """Record one measured time; calibration points are `pinned` and never slide out."""
        point = (shape.features(self.knots), seconds)
        (self._pinned.append if pinned else self._recent.append)(point)
        self._since_fit += 1
        if self._since_fit >= self.refit_every or pinned:
            self.fit()

    def fit(self) -> None:
        points = self._pinned + list(self._recent)
        if len(points) >= 2:
            x = np.array([p[0] for p in points])  # (n, features)
            y = np.array([p[1] for p in points])  # (n,)
            scale = 1.0 / np.maximum(y, 1e-6)  # (n,) fit relative error: a 20 ms decode counts as much as a 2 s prefill
            x = np.hstack([x, -x[:, :1]])  # (n, features + 1): the per-forward term may be negative, see below
            w = nnls(x * scale[:, None], y * scale)
            self.weights = w[:-1]
            self.weights[0] -= w[-1]
        self._since_fit = 0

    def predict(self, shape: ForwardShape) -> float:
        return max(0.0, sum(w * f for w, f in zip(self.weights.tolist(), shape.features(self.knots))))


class StepCostModel:
    """Predicted seconds of one engine step = target forward + draft forwards + the step's own overhead.

    The overhead (scheduling, verification, detokenizing: everything outside the forwards) is
    c0 + c1 x emitting requests, fitted like the rest. It does not depend on k, but it is what makes
    a step that emits several tokens per request cheaper per token than several plain steps.
    """

    def __init__(self, window: int = 256, refit_every: int = 16, online: bool = True,
                 knots: Sequence[int] = KNOTS) -> None:
        self.target = LinearCost(knots, window=window, refit_every=refit_every)
        self.draft = LinearCost(knots, window=window, refit_every=refit_every)
        self.overhead = LinearCost((), window=window, refit_every=refit_every)  # ForwardShape(1, requests)
        self.online = online  # False: observations are ignored, the coefficients stay as given

    @classmethod
    def from_weights(cls, target: Sequence[float], draft: Sequence[float], online: bool = False,
                     overhead: Sequence[float] = ()) -> "StepCostModel":
        """A model with given coefficients (synthetic costs in tests, a saved fit), frozen unless `online`.

        Weights are in feature order (ForwardShape.features); missing trailing ones are zero, so
        [w0, w1, w2] gives a plain linear model.
        """
        model = cls(online=online)
        for cost, weights in ((model.target, target), (model.draft, draft), (model.overhead, overhead)):
            cost.weights[:len(weights)] = np.array(weights, float)
        return model

    @property
    def fitted(self) -> bool:
        """Whether it can predict: calibrated, observed, or given weights."""
        return bool(self.target.weights.any())

    def observe(self, target: ForwardShape, target_s: float, draft: ForwardShape | None = None,
                draft_s: float = 0.0, pinned: bool = False, requests: int = 0, overhead_s: float | None = None) -> None:
        """Record a step's measured phases; `overhead_s` is the rest of a step that emitted for `requests`."""
        if not self.online:
            return
        self.target.observe(target, target_s, pinned)
        if draft is not None and draft.forwards:
            self.draft.observe(draft, draft_s, pinned)
        if overhead_s is not None and requests:
            self.overhead.observe(ForwardShape(1, requests), overhead_s, pinned)

    def predict(self, target: ForwardShape, draft: ForwardShape, requests: int = 0) -> float:
        """Seconds of a step with these forwards, emitting for `requests` requests."""
        seconds = self.target.predict(target) + (self.draft.predict(draft) if draft.forwards else 0.0)
        return seconds + (self.overhead.predict(ForwardShape(1, requests)) if requests else 0.0)

    def as_dict(self) -> dict:
        return {name: [round(float(w), 8) for w in cost.weights]
                for name, cost in (("target", self.target), ("draft", self.draft), ("overhead", self.overhead))}

"""Step-time cost model: linear in a few batch features, fitted from measured times and re-fitted online.

SmartSpec (Liu et al., arXiv 2406.14066) models a verification step's latency as linear in the batch's
tokens; we fit two such models, one for the target's forward and one for the draft's forwards, because
their features move independently with k:

  target seconds = a0 + a1 * tokens + a2 * attention          (one forward per step)
  draft  seconds = b0 * forwards + b1 * rows + b2 * attention  (k_max forwards per step)

where `tokens` (`rows`) counts new tokens fed, and `attention` sums new tokens x context length over
requests, in units of 1024 token pairs. Coefficients are non-negative (a lower bound of zero keeps
an extrapolation from predicting negative time) and fitted by least squares over the calibration
points plus a sliding window of recent steps, so a model fitted on one machine follows load drift.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ATTENTION_UNIT = 1024.0


@dataclass(frozen=True)
class ForwardShape:
    """What one phase of a step processed: forwards run, tokens fed, attention work."""

    forwards: int = 0
    tokens: int = 0
    attention: float = 0.0  # sum over requests of new tokens x context, / ATTENTION_UNIT

    def features(self, intercept: bool) -> list[float]:
        """Target: [1, tokens, attention]; draft: [forwards, tokens, attention] (no cost when it did not run)."""
        first = (1.0 if self.forwards else 0.0) if intercept else float(self.forwards)
        return [first, float(self.tokens), self.attention]


def nnls(x: np.ndarray, y: np.ndarray, ridge: float = 1e-9) -> np.ndarray:
    """Non-negative least squares by active set elimination: min |x w - y|, w >= 0. x: (n, f), y: (n,)."""
    f = x.shape[1]
    active = list(range(f))
    w = np.zeros(f)
    while active:
        xa = x[:, active]
        sol = np.linalg.solve(xa.T @ xa + ridge * np.eye(len(active)), xa.T @ y)  # (len(active),)
        if (sol >= 0).all():
            w[:] = 0.0
            w[active] = sol
            return w
        active = [a for a, s in zip(active, sol) if s > 0] if (sol > 0).any() else []
    return w


class LinearCost:
    """seconds = w . features, w >= 0, fitted on pinned points plus the last `window` observations."""

    def __init__(self, intercept: bool, window: int = 256, refit_every: int = 16) -> None:
        self.intercept = intercept
        self.refit_every = refit_every
        self._pinned: list[tuple[list[float], float]] = []
        self._recent: deque[tuple[list[float], float]] = deque(maxlen=window)
        self._since_fit = 0
        self.weights = np.zeros(3)

    @property
    def num_observations(self) -> int:
        return len(self._pinned) + len(self._recent)

    def observe(self, shape: ForwardShape, seconds: float, pinned: bool = False) -> None:
        """Record one measured time; calibration points are `pinned` and never slide out."""
        point = (shape.features(self.intercept), seconds)
        (self._pinned.append if pinned else self._recent.append)(point)
        self._since_fit += 1
        if self._since_fit >= self.refit_every or pinned:
            self.fit()

    def fit(self) -> None:
        points = self._pinned + list(self._recent)
        if len(points) >= 2:
            x = np.array([p[0] for p in points])  # (n, 3)
            y = np.array([p[1] for p in points])  # (n,)
            self.weights = nnls(x, y)
        self._since_fit = 0

    def predict(self, shape: ForwardShape) -> float:
        return float(np.dot(self.weights, shape.features(self.intercept)))


class StepCostModel:
    """Predicted seconds of one engine step = target forward + draft forwards."""

    def __init__(self, window: int = 256, refit_every: int = 16, online: bool = True) -> None:
        self.target = LinearCost(intercept=True, window=window, refit_every=refit_every)
        self.draft = LinearCost(intercept=False, window=window, refit_every=refit_every)
        self.online = online  # False: observations are ignored, the coefficients stay as given

    @classmethod
    def from_weights(cls, target: Sequence[float], draft: Sequence[float], online: bool = False) -> "StepCostModel":
        """A model with given coefficients (synthetic costs in tests, a saved fit), frozen unless `online`."""
        model = cls(online=online)
        model.target.weights, model.draft.weights = np.array(target, float), np.array(draft, float)
        return model

    @property
    def fitted(self) -> bool:
        """Whether it can predict: calibrated, observed, or given weights."""
        return bool(self.target.weights.any())

    def observe(self, target: ForwardShape, target_s: float, draft: ForwardShape | None = None,
                draft_s: float = 0.0, pinned: bool = False) -> None:
        if not self.online:
            return
        self.target.observe(target, target_s, pinned)
        if draft is not None and draft.forwards:
            self.draft.observe(draft, draft_s, pinned)

    def predict(self, target: ForwardShape, draft: ForwardShape) -> float:
        return self.target.predict(target) + (self.draft.predict(draft) if draft.forwards else 0.0)

    def as_dict(self) -> dict:
        return {"target": [round(float(w), 8) for w in self.target.weights],
                "draft": [round(float(w), 8) for w in self.draft.weights]}

"""The fleet's queue trend for a predictive step up: how fast its waiting requests grow, with a confidence bound.

A reactive autoscaler steps up once a signal is over its target; a new instance then serves only after its start
(a Ray worker and a model load, 6-7 s in `specfleet bench elastic`), and the requests arriving meanwhile wait. The
predictive step up (cluster/autoscale.py) instead asks whether the load, projected one start ahead, would be over its
target, as Dynamo's SLA planner forecasts the next interval's load (its constant, ARIMA, Prophet and Kalman
predictors) and Netflix Scryer / AWS predictive scaling start capacity ahead of the demand it forecasts.

The forecast here is a local trend: the fleet's queue (requests waiting, summed over the serving instances) sampled
over the last `window_s` seconds, its growth rate `(last - first) / elapsed`, and that rate's
standard error taken as a random walk's, `sqrt(m) * std(increments) / elapsed` over the m increments between
samples. A queue fed by Poisson arrivals wanders like a random walk, so the residuals of a straight-line fit
understate how far a flat load strays (a least-squares slope with residual errors fired on 4 to 20 of 20 steady
loads in the policy's simulator); the increments' spread does not. Projected forward, the rate is used at its lower
one-sided confidence bound, `rate - z * stderr`, never below 0: a load that only jitters projects flat, and prediction
adds no step there, while a queue that climbs steadily projects its climb. The queue, not every request in the fleet:
requests filling free slots after a rise to a new rate that the fleet can serve settle at a new level, and a line
through that fill would project a growth that stops (at 1,000 instances the policy then stepped up and back down
three times where it should change direction once); the queue grows only while arrivals outrun the fleet's
service, which is the growth that continues. Pure: times are passed in.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Trend:
    """The fitted rate of change over the window: requests per second, its standard error, the samples it saw."""

    slope: float
    stderr: float
    samples: int

    def lower(self, z: float) -> float:
        """The slope's lower one-sided confidence bound, at least 0 (a falling load projects flat, not down)."""
        return max(0.0, self.slope - z * self.stderr)


class DemandTrend:
    """The last `window_s` seconds of (time, count) samples and their growth rate."""

    def __init__(self, window_s: float, min_samples: int = 4, max_samples: int = 10_000) -> None:
        if window_s <= 0 or min_samples < 3:
            raise ValueError(f"a trend needs window_s > 0 and min_samples >= 3, got {window_s}, {min_samples}")
        self.window_s = window_s
        self.min_samples = min_samples
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, now: float, demand: float) -> None:
        self._samples.append((now, demand))
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()

    def clear(self) -> None:
        """Forget the samples (the fleet changed size: its demand before and after is not one series)."""
        self._samples.clear()

    def trend(self) -> Trend | None:
        """The growth rate over the samples in the window; None with fewer than `min_samples` or no time between
        the first and the last.

        >>> t = DemandTrend(10.0)
        >>> for s in range(5): t.add(float(s), 2.0 * s)
        >>> t.trend()
        Trend(slope=2.0, stderr=0.0, samples=5)
        """
        n = len(self._samples)
        if n < self.min_samples:
            return None
        (t0, y0), (t1, y1) = self._samples[0], self._samples[-1]
        elapsed = t1 - t0
        if elapsed <= 0.0:
            return None
        steps = [b - a for (_, a), (_, b) in zip(self._samples, list(self._samples)[1:])]  # m = n - 1 increments
        mean = sum(steps) / len(steps)
        var = sum((d - mean) ** 2 for d in steps) / (len(steps) - 1)
        return Trend((y1 - y0) / elapsed, math.sqrt(len(steps) * var) / elapsed, n)

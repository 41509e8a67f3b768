"""Benchmark reports: what a measured setting produced, percentiles of the figures, and the JSON file and plot the flags
name (each optional)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cluster.request import SpecStats


@dataclass(kw_only=True)
class Measured:
    """What one measured setting produced: tokens in seconds, its speculation counters and its outputs (a benchmark's
    row subclasses it with its own name and setup, which come first in its constructor)."""

    tokens: int = 0
    seconds: float = 0.0
    stats: SpecStats = field(default_factory=SpecStats)
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def save(report: dict, json_path: Path | None, plot_path: Path | None, plot: Callable[[dict, Path], None]) -> None:
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2))
    if plot_path:
        plot(report, plot_path)

"""Benchmark reports: percentiles of the figures, and the JSON file and plot the flags name (each optional)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path


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

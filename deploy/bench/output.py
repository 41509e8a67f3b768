"""Where a benchmark's report goes: the JSON file and the plot its flags name (each optional)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def save(report: dict, json_path: Path | None, plot_path: Path | None, plot: Callable[[dict, Path], None]) -> None:
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2))
    if plot_path:
        plot(report, plot_path)

"""`bench group-step` runs its gloo group and reports each way's time from every rank."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from deploy.bench import group_step

pytestmark = pytest.mark.heavy  # the fast tier leaves it out: it starts a process group of ranks


def test_group_step_reports_every_rank(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    group_step.add_arguments(p)
    out = tmp_path / "step.json"
    args = p.parse_args(["--hidden", "32", "--intermediate", "64", "--steps", "20", "--dtype", "fp32",
                         "--json", str(out)])
    assert group_step.run(args) == 0
    report = json.loads(out.read_text())
    assert len(report["per_rank"]) == 2
    for rank in report["per_rank"]:
        assert set(rank) == {"mlp_alone", "exchange_alone", "group_step"}
        assert all(0 < t["median_ms"] <= t["p90_ms"] and t["mean_ms"] > 0 for t in rank.values())
    # the pace is the slowest rank's
    assert report["mean_ms"]["group_step"] == round(max(r["group_step"]["mean_ms"] for r in report["per_rank"]), 3)
    m = {k: max(r[k]["mean_ms"] for r in report["per_rank"]) for k in ("group_step", "mlp_alone")}
    assert report["step_over_layers_in_order"] == round(m["group_step"] / (2 * m["mlp_alone"]), 3)

"""`specfleet bench disagg` end to end on the tiny llama over the test cluster: both runs complete every request, the
disaggregated one splits the long prompts and hands them off, and the short requests' outputs are the same in both
(the figures themselves are the benchmark's, not the test's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.infra import local_cluster
from tests.fixtures.tiny_models import build_tiny_model

# the bench end to end is a run of a minute or more (CI time, issue 36): in the slow tier (`pytest -m slow tests/ray`),
# the components it drives keep their own tests in the default suite
pytestmark = pytest.mark.slow


def test_bench_disagg_runs_both_modes_losslessly(ray_cluster, tmp_path: Path) -> None:
    report_path = tmp_path / "disagg.json"
    model = build_tiny_model("llama", tmp_path / "model", max_position_embeddings=2048)
    args = ["--model", str(model), "--short-requests", "3", "--short-rate", "20", "--short-prompt", "16",
            "--short-tokens", "24", "--long-requests", "2", "--long-rate", "20", "--long-prompt", "400",
            "--long-tokens", "1200", "--num-cpus", "0.5", "--state", str(ray_cluster.state_path),
            "--json", str(report_path)]
    out = subprocess.run([sys.executable, "-m", "deploy.cli", "bench", "disagg", *args], capture_output=True,
                         text=True, timeout=600, env={**os.environ, **local_cluster.RAY_ENV})
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    report = json.loads(report_path.read_text())
    agg, dis = report["modes"]["aggregated"], report["modes"]["disaggregated"]
    assert agg["completed"] == agg["of"] == dis["completed"] == dis["of"] == 5
    assert agg["placements"] == {} and dis["placements"] == {"short_prompt": 3 + 1, "disaggregated": 2}, dis
    # each long prompt moved after its first token (or tried to, or ended first: 1,200 tokens make that unlikely)
    assert sum(dis["handoffs"].values()) == 2 and dis["handoffs"].get("finished", 0) >= 1, dis
    assert report["identical"] and agg["short_itl_ms_p99"] > 0 and dis["short_itl_ms_p99"] > 0
    assert "long-prompt interference" in out.stdout

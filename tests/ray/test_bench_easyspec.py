"""`specfleet bench easyspec` end to end on the tiny llama pair over the test cluster: every setting runs as draft
actors and, in fp32, decodes exactly what sequential drafting decodes (the speeds are the benchmark's, not the test's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.infra import local_cluster

# the bench end to end is a run of a minute or more (CI time, issue 36): in the slow tier (`pytest -m slow tests/ray`),
# the components it drives keep their own tests in the default suite
pytestmark = pytest.mark.slow


def test_bench_easyspec_runs_every_setting_losslessly(ray_cluster, tiny_models, tiny_draft_models, tmp_path) -> None:
    report_path, plot = tmp_path / "easyspec.json", tmp_path / "easyspec.png"
    args = ["--target", str(tiny_models["llama"]), "--draft", str(tiny_draft_models["llama"]), "--groups", "1,2",
            "--mode", "attention,layer", "--calibrate", "on,off", "--sequential-head", "1", "--sequential-tail", "0",
            "--num-prompts", "2", "--max-prompt-tokens", "32", "--max-tokens", "16", "--k", "3", "--num-cpus", "0.5",
            "--state", str(ray_cluster.state_path), "--json", str(report_path), "--plot", str(plot)]
    out = subprocess.run([sys.executable, "-m", "deploy.cli", "bench", "easyspec", *args], capture_output=True,
                         text=True, timeout=600, env={**os.environ, **local_cluster.RAY_ENV})
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    report = json.loads(report_path.read_text())
    assert plot.stat().st_size > 0
    rows = report["settings"]
    assert list(rows) == ["sequential", "group 2 attention", "group 2 attention uncalibrated", "group 2 layer",
                          "group 2 layer uncalibrated"]
    for name, r in rows.items():
        assert r["identical_to_sequential"] == 1.0, name  # lossless in fp32, calibrated or not
        assert r["tokens"] == 2 * 16 and r["draft_ms_per_token"] > 0 and 0 <= r["acceptance"] <= 1, (name, r)
    assert rows["sequential"]["draft_speedup"] == 1.0 and rows["group 2 layer"]["parallel"]["group_size"] == 2
    assert "EasySpec on" in out.stdout

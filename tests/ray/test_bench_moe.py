"""`specfleet bench moe` end to end on the tiny Mixtral over the test cluster: every setting runs as expert-parallel
rank actors and decodes exactly what one process decodes (the figures are the benchmark's, not the test's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from deploy.infra import local_cluster

# the bench end to end is a run of a minute or more (CI time, issue 36): in the slow tier (`pytest -m slow tests/ray`),
# the components it drives keep their own tests in the default suite
pytestmark = pytest.mark.slow


def test_bench_moe_runs_every_setting_losslessly(ray_cluster, tiny_models, tmp_path) -> None:
    report_path, plot, keep = tmp_path / "moe.json", tmp_path / "moe.png", tmp_path / "experts"
    args = ["--model", str(tiny_models["mixtral"]), "--ranks", "2", "--profile-prompts", "6", "--num-prompts", "4",
            "--max-prompt-tokens", "32", "--max-tokens", "8", "--batch", "4", "--num-cpus", "0.5",
            "--state", str(ray_cluster.state_path), "--out", str(keep), "--json", str(report_path), "--plot", str(plot)]
    out = subprocess.run([sys.executable, "-m", "deploy.cli", "bench", "moe", *args], capture_output=True,
                         text=True, timeout=600, env={**os.environ, **local_cluster.RAY_ENV})
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    report = json.loads(report_path.read_text())
    assert plot.stat().st_size > 0 and (keep / "routing.safetensors").exists() and (keep / "plan-2.json").exists()
    rows = report["ranks"]["2"]
    assert list(rows) == ["plain", "grouped", "grouped+pre", "tp", "tp+grouped", "tp+shuffle"]
    for name, r in rows.items():
        assert r["identical_to_one_process"], name  # lossless: placement changes what crosses, never the output
        assert 0 < r["local_activation_rate"] < 1 and r["alltoall_bytes_per_token"] > 0 and r["tok_s"] > 0, (name, r)
        assert (r["attention_bytes_per_token"] > 0) == name.startswith("tp"), (name, r)
    for baseline in ("plain", "tp"):  # each layout against its own
        assert rows[baseline]["bytes_reduction"] == 0.0 and rows[baseline]["local_rate_gain_points"] == 0.0
    assert report["moe_layers"] == 4 and report["top_k"] == 2 and len(report["usage_entropy"]) == 4
    assert "Speculative MoE on" in out.stdout

"""`specfleet bench migration` end to end on the tiny llama over the test cluster: every part runs, and every migrated
or failed-over output equals its uninterrupted run (the figures themselves are the benchmark's, not the test's)."""

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


def test_bench_migration_runs_every_part_losslessly(ray_cluster, tmp_path: Path) -> None:
    report_path, plot = tmp_path / "migration.json", tmp_path / "migration.png"
    # a context long enough for streams that outlast a migration (about 1 s over a torch link here) on a loaded
    # machine (the tiny default is 256)
    model = build_tiny_model("llama", tmp_path / "model", max_position_embeddings=2048)
    args = ["--model", str(model), "--contexts", "48", "--repeats", "1", "--max-tokens", "1200",
            "--migrate-after", "2", "--failover-requests", "2", "--failover-context", "48", "--skew-requests", "4",
            "--skew-rate", "20", "--skew-prompt-tokens", "32", "--skew-max-tokens", "24", "--skew-fits", "2",
            "--parts", "downtime,failover,skew,draft", "--draft-layers", "0-1", "--draft-k", "3", "--num-cpus", "0.5",
            "--state", str(ray_cluster.state_path), "--json", str(report_path), "--plot", str(plot)]
    out = subprocess.run([sys.executable, "-m", "deploy.cli", "bench", "migration", *args], capture_output=True,
                         text=True, timeout=600, env={**os.environ, **local_cluster.RAY_ENV})
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    report = json.loads(report_path.read_text())
    assert plot.stat().st_size > 0
    assert [p["context"] for p in report["downtime"]] == [48]  # one context: the sweep is a loop; each costs 6 long streams
    for part in report["downtime"]:
        for mode in ("staged", "stop_and_copy", "staged_object_store", "stop_and_copy_object_store"):
            assert part[mode]["finished"] == part[mode]["of"] == 1 and part[mode]["identical"], part[mode]["runs"]
            assert part[mode]["downtime_ms_median"] > 0
        assert part["stop_and_copy"]["stages_median"] == 0 and part["staged"]["stages_median"] >= 1
        assert {r["transfer"] for r in part["staged"]["runs"]} == {"torch"}  # the channel opened
        assert {r["transfer"] for r in part["staged_object_store"]["runs"]} == {"object_store"}
    f = report["failover"]
    assert f["requests"] == 2 and f["lost"] == 0 and f["identical"] and not f["errors"], f
    assert "bench-victim" not in f["resumed_on"]
    skew = report["skew"]
    assert skew["identical"] and skew["off"]["completed"] == skew["on"]["completed"] == 4
    assert skew["off"]["migrations"] == 0
    for part in report["draft"]:  # a self-speculative draft's KV moved before the stop, or rebuilt
        moved, rebuilt = part["draft_moved"], part["draft_rebuilt"]
        for mode in (moved, rebuilt):
            assert mode["finished"] == mode["of"] == 1 and mode["identical"], mode["runs"]
        assert moved["runs"][0]["draft_tokens"] >= part["context"] and rebuilt["runs"][0]["draft_tokens"] == 0
    assert "context 48: downtime staged" in out.stdout and "skewed Poisson load" in out.stdout

"""`specfleet bench prefix` end to end on the tiny llama over the test cluster: both variants and the three modes run,
their outputs agree, the cache-aware run finds its prefixes, and the migration with a cached prefix moves fewer bytes
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


def test_bench_prefix_runs_every_mode_with_identical_outputs(ray_cluster, tmp_path: Path) -> None:
    report_path = tmp_path / "prefix.json"
    model = build_tiny_model("llama", tmp_path / "model", max_position_embeddings=2048)  # streams that outlast a migration
    args = ["--model", str(model), "--conversations", "4", "--rate", "20", "--max-tokens", "8",
            "--system-prompt-tokens", "96", "--block-size", "4", "--num-blocks", "512", "--num-cpus", "0.5",
            "--migration-tokens", "1200", "--state", str(ray_cluster.state_path), "--json", str(report_path)]
    out = subprocess.run([sys.executable, "-m", "deploy.cli", "bench", "prefix", *args], capture_output=True,
                         text=True, timeout=600, env={**os.environ, **local_cluster.RAY_ENV})
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    report = json.loads(report_path.read_text())
    assert set(report["variants"]) == {"mtbench", "system"}
    for name, variant in report["variants"].items():
        runs = variant["runs"]
        assert variant["identical"] and set(runs) == {"off", "least_load", "cache_aware"}, name
        assert all(r["requests"] == 8 and r["tok_s"] > 0 for r in runs.values())
        assert runs["off"]["hit_rate"] == 0 and runs["cache_aware"]["hit_rate"] > 0
        assert runs["cache_aware"]["decisions"].get("prefix", 0) >= 4  # every second turn went to its first
        m = runs["cache_aware"]["migration"]
        assert m["cached"]["status"] == m["cold"]["status"] == "finished" and m["cached"]["identical"]
        assert m["cold"]["identical"] and m["cold"]["tokens_skipped"] == 0 and m["cached"]["tokens_skipped"] > 0
    assert report["variants"]["system"]["runs"]["cache_aware"]["migration"]["bytes_saved"] >= 0.5
    assert "hit rate, cache_aware / least_load" in out.stdout

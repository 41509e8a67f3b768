"""`specfleet bench agent` end to end on a tiny hermes-style model over the test cluster: the three modes serve the
agent loop (the first turn must call a tool, whose scripted result goes back), every turn's tokens agree across the
modes, and the report holds each mode's figures and ratios (the figures themselves are the benchmark's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.infra import local_cluster
from tests.fixtures.agent_model import AGENT_TOKENS, HERMES_TEMPLATE
from tests.fixtures.tiny_models import build_tiny_model

# the bench end to end is a run of a minute or more (CI time, issue 36): in the slow tier (`pytest -m slow tests/ray`),
# the components it drives keep their own tests in the default suite
pytestmark = pytest.mark.slow


def test_bench_agent_runs_every_mode_with_identical_turns(ray_cluster, tmp_path: Path) -> None:
    model = build_tiny_model("llama", tmp_path / "model", chat_template=HERMES_TEMPLATE, added_tokens=AGENT_TOKENS,
                             max_position_embeddings=4096)
    report_path = tmp_path / "agent.json"
    args = ["--model", str(model), "--dtype", "fp32", "--conversations", "2", "--concurrency", "1,2",
            "--max-turns", "2", "--max-tokens", "100", "--num-cpus", "0.5", "--state", str(ray_cluster.state_path),
            "--json", str(report_path)]
    out = subprocess.run([sys.executable, "-m", "deploy.cli", "bench", "agent", *args], capture_output=True,
                         text=True, timeout=900, env={**os.environ, **local_cluster.RAY_ENV})
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    report = json.loads(report_path.read_text())
    assert set(report["levels"]) == {"1", "2"}
    for level in report["levels"].values():
        runs = level["runs"]
        assert level["identical"] and set(runs) == {"off", "ngram", "suffix"}
        for name, r in runs.items():
            assert r["conversations"] == 2 and r["turns"] >= 2 and r["tok_s"] > 0 and r["turn_s_mean"] > 0
            assert r["calls"] >= 1, name  # the first turn must call (tool_choice required, within 100 tokens)
        assert runs["off"]["speedup_tok_s"] == 1.0 and runs["off"]["acceptance"] is None
        assert runs["ngram"]["acceptance"] is not None
    assert "best speculation / off at concurrency 1" in out.stdout

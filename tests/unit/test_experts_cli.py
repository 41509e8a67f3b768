"""`specfleet experts profile|plan|apply|status` in a subprocess on the tiny Mixtral: files that load, clear errors."""

from __future__ import annotations

import json

import pytest
import yaml

from actors.moe.profile import ExpertRoutingStats
from cluster.config import load_config
from placement.experts import ExpertPlan
from tests.unit.test_cli import specfleet

pytestmark = pytest.mark.heavy  # the fast tier leaves it out: every test runs the CLI in a subprocess (a model load each)


def test_profile_plan_apply_status_end_to_end(tiny_models, tmp_path) -> None:
    model = str(tiny_models["mixtral"])
    stats, plan = tmp_path / "routing.safetensors", tmp_path / "plan.json"

    out = specfleet("experts", "profile", "--model", model, "--num-prompts", "6", "--max-prompt-tokens", "32",
                    "--out", str(stats))
    assert out.returncode == 0, out.stderr
    got = ExpertRoutingStats.load_file(stats)
    assert got.layers == (0, 1, 2, 3) and got.tokens == 6 * 32 and int(got.load.sum()) == got.tokens * 2 * 4

    out = specfleet("experts", "plan", "--stats", str(stats), "--ranks", "2", "--out", str(plan))
    assert out.returncode == 0, out.stderr
    p = ExpertPlan.model_validate_json(plan.read_text())
    assert p.num_ranks == 2 and all(sorted(row) == [0, 0, 1, 1] for row in p.ranks)
    assert "pair mass kept on one rank" in out.stdout

    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"engine": {"model": {"target": model}}}))
    grouped = tmp_path / "grouped.yaml"
    out = specfleet("experts", "apply", "--plan", str(plan), "--stats", str(stats), "--config", str(base),
                    "--out", str(grouped))
    assert out.returncode == 0, out.stderr
    cfg = load_config(grouped)
    assert cfg.engine.experts.ranks == 2 and cfg.engine.experts.plan == str(plan.resolve())
    assert cfg.engine.experts.stats == str(stats.resolve()) and cfg.fleet.pipeline_stages == 2
    assert cfg.engine.experts.attention == "data"
    shuffled = tmp_path / "shuffled.yaml"  # token-level pre-scheduling: heads split over the ranks
    out = specfleet("experts", "apply", "--plan", str(plan), "--stats", str(stats), "--attention", "tensor",
                    "--config", str(base), "--out", str(shuffled))
    assert out.returncode == 0, out.stderr
    assert load_config(shuffled).engine.experts.attention == "tensor"

    out = specfleet("experts", "status", "--stats", str(stats), "--plan", str(plan))
    assert out.returncode == 0, out.stderr
    assert "usage entropy" in out.stdout and "rank 1" in out.stdout


def test_bad_expert_input_gives_a_clear_message(tiny_models, tmp_path) -> None:
    out = specfleet("experts", "plan", "--stats", str(tmp_path / "missing.safetensors"), "--ranks", "2",
                    "--out", str(tmp_path / "p.json"))
    assert out.returncode == 2 and "not routing statistics" in out.stderr and "Traceback" not in out.stderr
    dense = tmp_path / "dense.yaml"
    dense.write_text(yaml.safe_dump({"engine": {"model": {"target": str(tiny_models["llama"])}}}))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"num_ranks": 2, "layers": [0], "ranks": [[0, 0, 1, 1]]}))
    out = specfleet("experts", "apply", "--plan", str(plan), "--config", str(dense), "--out", str(tmp_path / "o.yaml"))
    assert out.returncode == 2 and "not a MoE model" in out.stderr, out.stderr
    out = specfleet("experts", "profile", "--model", str(tiny_models["llama"]), "--num-prompts", "1",
                    "--out", str(tmp_path / "s.safetensors"))
    assert out.returncode == 2 and "no MoE layers" in out.stderr, out.stderr


def test_online_profiling_needs_a_reachable_app(tmp_path) -> None:
    out = specfleet("experts", "profile", "--online", "inst-0", "--url", "http://127.0.0.1:9", "--admin-key", "k",
                    "--out", str(tmp_path / "s.safetensors"))
    assert out.returncode == 2 and "not reachable" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "s.safetensors").exists()

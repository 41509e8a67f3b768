"""`specfleet bench dtype` runs each ISA path in a process of its own and reports fp32 and bf16 side by side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.heavy  # two child processes, each loading the model twice
def test_bench_dtype_reports_both_dtypes_per_path(tiny_models, tmp_path: Path) -> None:
    report_path = tmp_path / "dtype.json"
    out = subprocess.run([sys.executable, "-m", "deploy.cli", "bench", "dtype", "--model", str(tiny_models["llama"]),
                          "--isas", "torch", "avx2", "--as-avx2", "--prompt-tokens", "40", "--decode-prompts", "2",
                          "--max-tokens", "4", "--json", str(report_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["command"] == "specfleet bench dtype --as-avx2" and list(report["paths"]) == ["torch", "avx2"]
    for figures in report["paths"].values():
        assert set(figures) == {"fp32", "bf16"}
        assert all(f["ttft_s"] > 0 and f["decode_tok_s"] > 0 for f in figures.values())
    assert "avx2" in out.stdout and "torch" in out.stdout  # the table's rows

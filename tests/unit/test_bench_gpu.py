"""`specfleet bench gpu` / `make gpu-check` (deploy/bench/gpu.py) where no GPU is: it stops at once and says why; its
steps run under deadlines that kill their whole process tree; its docs section is replaced between its markers only."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from deploy.bench import gpu
from deploy.bench.gpu import BEGIN, END, Step, StepResult, render, replace_section, run_step

ROOT = Path(__file__).resolve().parents[2]


def test_without_a_cuda_device_the_check_stops_at_once_and_writes_nothing(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}  # no GPU, even on a machine with one
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "bench", "gpu", "--docs", str(docs)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "gpu-check: no CUDA device" in done.stderr and "nothing was run" in done.stderr
    assert time.monotonic() - t0 < 120  # the time to import torch, not to run any step
    assert docs.read_text() == "# Benchmarks\n"


def test_the_make_target_runs_the_command() -> None:
    make = subprocess.run(["make", "-n", "-o", ".venv/.installed", "gpu-check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=30)
    assert make.returncode == 0, make.stderr
    assert "-m deploy.cli bench gpu" in make.stdout


def test_a_section_is_appended_once_then_replaced_between_its_markers() -> None:
    doc = "# Benchmarks\n\n## Earlier\n\ntext\n"
    first = replace_section(doc, "## On a GPU\n\nrun 1\n")
    assert first.startswith(doc.rstrip("\n")) and first.endswith(f"{BEGIN}\n## On a GPU\n\nrun 1\n{END}\n")
    later = first + "\n## Added after\n\nmore\n"
    second = replace_section(later, "## On a GPU\n\nrun 2\n")
    assert "run 1" not in second and second.count("run 2") == 1
    assert second.replace("run 2", "run 1") == later  # everything outside the markers kept, byte for byte
    assert replace_section(second, "## On a GPU\n\nrun 2\n") == second


@pytest.mark.parametrize("doc", [f"a\n{BEGIN}\nb\n", f"a\n{END}\nb\n", f"{END}\nx\n{BEGIN}\n",
                                 f"{BEGIN}\n1\n{END}\n{BEGIN}\n2\n{END}\n"],
                         ids=["begin only", "end only", "end before begin", "two sections"])
def test_a_doc_whose_markers_do_not_pair_is_refused(doc: str) -> None:
    with pytest.raises(ValueError, match="not one pair in order"):
        replace_section(doc, "body")


def test_the_project_doc_takes_the_section() -> None:
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    out = replace_section(doc, "## x\n")
    assert out.count(BEGIN) == out.count(END) == 1 and out.startswith(doc[:doc.find(BEGIN)] if BEGIN in doc else doc)


def test_the_rendered_table_has_a_row_per_step_and_keeps_its_columns() -> None:
    results = [StepResult("lossless unit tier (CUDA)", "passed", 81.2, "130 passed, 0 failed, 2 skipped in 80.1s"),
               StepResult("bench spec (CUDA)", "failed", 3.0, "exit code 1 | a pipe")]
    body = render(results, {"command": "make gpu-check", "devices": "1 x H200", "torch": "2.13.0",
                            "date": "2026-11-28", "seconds": "90", "budget_s": "480"})
    rows = [line for line in body.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split(" | ")[0].lstrip("| ") for r in rows] == [r.name for r in results]
    assert all(r.count("|") == 5 for r in rows)
    assert "| failed | 3.0 |" in body and "1 x H200" in body


def test_a_step_past_its_deadline_is_killed_with_its_children(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    script = ("import subprocess, sys, time\n"
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
              f"open({str(pid_file)!r}, 'w').write(str(c.pid))\n"
              "time.sleep(120)\n")
    t0 = time.monotonic()
    result = run_step(Step("sleeper", (sys.executable, "-c", script), timeout_s=5))
    assert result.status == "timed out" and result.summary == "killed after 5s"
    assert time.monotonic() - t0 < 60
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the step's child outlived its deadline"
        time.sleep(0.1)


def test_a_pytest_step_reports_its_counts(tmp_path: Path) -> None:
    tests = tmp_path / "test_three.py"
    tests.write_text("import pytest\n\ndef test_ok():\n    pass\n\ndef test_bad():\n    assert 1 == 2\n\n"
                     "def test_skip():\n    pytest.skip('no')\n")
    junit = tmp_path / "out.xml"
    result = run_step(Step("three", (sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml",
                                     str(junit), str(tests)), timeout_s=240, junit=junit))
    assert result.status == "failed"
    assert result.summary.startswith("1 passed, 1 failed, 1 skipped in ")
    assert "assert 1 == 2" in result.tail


def test_the_nccl_step_says_why_it_does_not_run_without_two_gpus(tmp_path: Path) -> None:
    report = tmp_path / "nccl.json"
    result = run_step(Step("NCCL", (sys.executable, "-m", "deploy.bench.gpu_links", "--json", str(report)),
                           timeout_s=240, env={"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}, report=report))
    assert result.status == "not run", result.tail
    assert result.summary == "not run: 0 GPU: NCCL needs one GPU per rank (NCCL refuses two ranks on one GPU)"


def test_the_steps_fit_the_budget_and_put_the_tests_on_cuda(tmp_path: Path) -> None:
    args = gpu.argparse.Namespace(target="t", draft="d", num_prompts=4, max_tokens=64)
    steps = gpu.steps(args, tmp_path)
    assert sum(s.timeout_s for s in steps) <= 480
    tests = [s for s in steps if s.junit is not None]
    assert tests and all(s.env["SPECFLEET_TEST_DEVICE"] == "cuda" for s in tests)
    assert all((ROOT / f).exists() for s in tests for f in s.cmd if f.startswith("tests/"))

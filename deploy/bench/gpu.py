"""`specfleet bench gpu` (`make gpu-check`): on a lent GPU, in one command within 8 minutes, the lossless unit tier on
CUDA, the pipeline and KV-link paths on CUDA (NCCL between two GPUs where there are two), and `bench spec`; the
figures go to docs/benchmarks.md, between markers, replacing the last run's.

Each step is a child process with its own deadline (the whole check's budget shared out in order, the most
important first), killed with its children when the deadline passes; a step that fails or runs out of time is
recorded and the next one runs. Nothing here touches CUDA before the check starts: without a CUDA device it stops at
once and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "benchmarks.md"
BEGIN = "<!-- gpu-check:begin (written by `make gpu-check`; what is between the markers is replaced) -->"
END = "<!-- gpu-check:end -->"

# the lossless unit tier: every mode's output equals the target's own greedy output (tests/unit/helpers.py
# TEST_DEVICE puts their models on SPECFLEET_TEST_DEVICE)
LOSSLESS_TESTS = ("tests/unit/test_lossless.py", "tests/unit/test_generic_lossless.py",
                  "tests/unit/test_prefix_lossless.py")
# a pipeline's stages and a migration's KV between stages and instances, over links (gloo carrying CUDA tensors
# on one GPU; NCCL where both ends are GPUs)
LINK_TESTS = ("tests/unit/test_pipeline.py", "tests/unit/test_kv_links.py", "tests/unit/test_kv_channel.py")

Status = Literal["passed", "failed", "timed out", "not run"]


class NoCudaDevice(RuntimeError):
    """The check needs a CUDA device and this machine shows none."""


@dataclass(frozen=True)
class Step:
    """A child process to run with a deadline; `report` is a JSON file it writes (its figures), if any."""

    name: str
    cmd: tuple[str, ...]
    timeout_s: float
    env: Mapping[str, str] = field(default_factory=dict)
    junit: Path | None = None  # a pytest step's JUnit XML: its counts
    report: Path | None = None


@dataclass(frozen=True)
class StepResult:
    name: str
    status: Status
    seconds: float
    summary: str  # the counts or figures, one line
    tail: str = ""  # the end of the output where the step did not pass


def cuda_devices() -> list[str]:
    """The names of the CUDA devices torch sees; NoCudaDevice (with why) where it sees none."""
    import torch

    if torch.version.cuda is None:
        raise NoCudaDevice(f"no CUDA device: torch {torch.__version__} is a CPU-only build")
    if not torch.cuda.is_available():
        raise NoCudaDevice(f"no CUDA device: torch {torch.__version__} (CUDA {torch.version.cuda}) finds none "
                           f"(driver, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def junit_counts(xml_text: str) -> dict[str, int | float]:
    """passed, failed (failures and errors), skipped and seconds from pytest's JUnit XML."""
    root = ET.fromstring(xml_text)
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = total["failures"] + total["errors"]
    return {"passed": total["tests"] - failed - total["skipped"], "failed": failed, "skipped": total["skipped"],
            "seconds": round(sum(float(s.get("time", 0)) for s in suites), 1)}


def run_step(step: Step) -> StepResult:
    """Run `step` in a session of its own; past its deadline the whole session (the step and its children) is
    killed."""
    t0 = time.monotonic()
    proc = subprocess.Popen(step.cmd, cwd=ROOT, env={**os.environ, **step.env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=step.timeout_s)
        status: Status = "passed" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        status = "timed out"
    seconds = round(time.monotonic() - t0, 1)
    summary = f"exit code {proc.returncode}" if status != "timed out" else f"killed after {step.timeout_s:.0f}s"
    if step.junit is not None and step.junit.exists():
        c = junit_counts(step.junit.read_text())
        summary = f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped in {c['seconds']}s"
    elif step.report is not None and step.report.exists():
        summary = summarize(step.name, json.loads(step.report.read_text()))
        if status == "passed" and summary.startswith("not run"):
            status = "not run"
    tail = "" if status == "passed" else "\n".join((out or "").strip().splitlines()[-15:])
    return StepResult(step.name, status, seconds, summary, tail)


def summarize(name: str, report: dict) -> str:
    """One line of a step's figures from its JSON report."""
    if "modes" in report:  # bench spec
        m = report["modes"]
        spec = m["b_spec"].get("spec", {})
        return (f"{report['target']} / {report['draft']}, {report['dtype']}, {report['num_prompts']} prompts x "
                f"{report['max_tokens']} tokens on {report['device']}: plain {m['a_plain']['tok_s']:.1f} tok/s, "
                f"speculative (k={report['k']}) {m['b_spec']['tok_s']:.1f} tok/s "
                f"({report['ratios'].get('b_spec/a_plain', 0):.2f}x), acceptance "
                f"{spec.get('acceptance_rate', float('nan')):.2f}, identical to plain "
                f"{m['b_spec']['identical_to_plain']:.2f}")
    if "ran" in report:  # gpu_links
        if not report["ran"]:
            return f"not run: {report['why']}"
        return (f"{report['gpus']} GPUs, pipeline P2P over {report['p2p_backend']}: exact {report['p2p_exact']}, "
                f"{report['p2p_gb_s']} GB/s; KV channel over nccl: exact {report['kv_exact']}, "
                f"{report['kv_bytes']} bytes onto {report['kv_device']}")
    return json.dumps(report)[:200]


def render(results: Sequence[StepResult], meta: Mapping[str, str]) -> str:
    """The docs section's body (below the section's heading and its description, which stay): what ran where, and
    a row per step."""
    lines = [f"Latest run: `{meta['command']}` on {meta['devices']} ({meta['date']}, torch {meta['torch']}, "
             f"{meta['seconds']} s in all, budget {meta['budget_s']} s). Written by the command itself; a step's "
             "deadline is its share of the budget.", "",
             "| step | status | seconds | result |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.name} | {r.status} | {r.seconds} | {r.summary.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def replace_section(doc: str, body: str) -> str:
    """`doc` with what lies between BEGIN and END replaced by `body`; the markers and body appended at the end if
    `doc` has none. A doc with only one marker, or more than one pair, is refused (ValueError): which part to
    replace would be a guess."""
    begins, ends = doc.count(BEGIN), doc.count(END)
    if begins == ends == 0:
        return doc.rstrip("\n") + "\n\n" + BEGIN + "\n" + body.rstrip("\n") + "\n" + END + "\n"
    if begins != 1 or ends != 1 or doc.index(BEGIN) > doc.index(END):
        raise ValueError(f"the doc holds {begins} begin and {ends} end markers of the gpu-check section, not one "
                         "pair in order")
    head, rest = doc.split(BEGIN)
    _, tail = rest.split(END)
    return head + BEGIN + "\n" + body.rstrip("\n") + "\n" + END + tail


def steps(args: argparse.Namespace, work: Path) -> list[Step]:
    """The check's steps, most important first; each deadline is set against the budget left when it starts."""
    py, cuda = sys.executable, {"SPECFLEET_TEST_DEVICE": "cuda"}

    def pytest(name: str, files: Sequence[str], timeout_s: float) -> Step:
        junit = work / f"{name.split()[0]}.xml"
        return Step(name, (py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", str(junit), *files),
                    timeout_s, cuda, junit=junit)

    return [
        pytest("lossless unit tier (CUDA)", LOSSLESS_TESTS, 210),
        pytest("links: pipeline and KV (CUDA)", LINK_TESTS, 90),
        Step("NCCL between two GPUs", (py, "-m", "deploy.bench.gpu_links", "--json", str(work / "nccl.json")),
             60, report=work / "nccl.json"),
        Step("bench spec (CUDA)", (py, "-m", "deploy.cli", "bench", "spec", "--target", args.target, "--draft",
                                   args.draft, "--device", "cuda", "--dtype", "bf16", "--draft-quantization", "none",
                                   "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens),
                                   "--no-peer", "--json", str(work / "spec.json")), 120, report=work / "spec.json"),
    ]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget-s", type=float, default=480, help="the whole check's time (default 8 minutes)")
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="bench spec's target (catalog name, GGUF, folder)")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="bench spec's draft")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--docs", type=Path, default=DOCS, help="the page whose gpu-check section is replaced")
    p.add_argument("--no-docs", action="store_true", help="print the figures only")


def run(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    try:
        devices = cuda_devices()
    except NoCudaDevice as e:
        print(f"gpu-check: {e}; nothing was run (the check needs a GPU: `make test` is the CPU's)", file=sys.stderr)
        return 2
    import torch

    print(f"gpu-check on {len(devices)} GPU(s): {', '.join(devices)}; budget {args.budget_s:.0f}s", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for step in steps(args, Path(tmp)):
            left = args.budget_s - (time.monotonic() - t0)
            if left < 10:
                results.append(StepResult(step.name, "timed out", 0.0, "not started: the budget was spent"))
                continue
            result = run_step(Step(step.name, step.cmd, min(step.timeout_s, left), step.env, step.junit, step.report))
            results.append(result)
            print(f"{result.name}: {result.status} in {result.seconds}s: {result.summary}", flush=True)
            if result.tail:
                print(result.tail, flush=True)
    meta = {"command": "make gpu-check", "devices": f"{len(devices)} x {devices[0]}", "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "seconds": f"{time.monotonic() - t0:.0f}",
            "budget_s": f"{args.budget_s:.0f}"}
    body = render(results, meta)
    print(body)
    if not args.no_docs:
        args.docs.write_text(replace_section(args.docs.read_text(), body))
        print(f"wrote the gpu-check section of {args.docs}")
    return 0 if all(r.status in ("passed", "not run") for r in results) else 1

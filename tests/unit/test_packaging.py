"""What a fresh machine installs and how the suite runs: declared in pyproject.toml, checked against the code."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _uses_create_task_context() -> list[str]:
    """Files calling `create_task(..., context=...)` (Python 3.11's keyword)."""
    found = []
    for path in ROOT.glob("[acdp]*/**/*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "create_task"
                    and any(k.arg == "context" for k in node.keywords)):
                found.append(str(path.relative_to(ROOT)))
    return found


def test_the_declared_python_is_one_the_code_runs_on() -> None:
    """On 3.10 `create_task(context=)` is a TypeError: every request a 500. The declared minimum must be 3.11."""
    declared = PYPROJECT["project"]["requires-python"]
    assert _uses_create_task_context(), "the check looks for nothing"
    assert declared.replace(" ", "") == ">=3.11", declared


def test_the_kernels_build_tool_is_a_dependency() -> None:
    """torch's extension builder runs `ninja`; without it our CPU kernels are off (actors/model/cpu_kernels.py)."""
    assert any(d.split(">")[0].split("=")[0].strip() == "ninja" for d in PYPROJECT["project"]["dependencies"])


def test_every_test_has_a_time_bound_and_skips_say_why() -> None:
    """One hung Ray call fails its test, not the CI job (pytest-timeout); `-r` with `s` prints each skip's reason."""
    opts = PYPROJECT["tool"]["pytest"]["ini_options"]
    assert any(d.startswith("pytest-timeout") for d in PYPROJECT["project"]["optional-dependencies"]["test"])
    assert int(opts["timeout"]) >= 600  # the slowest tests take minutes on a 2-core machine
    flags = next(f for f in opts["addopts"].split() if f.startswith("-r"))
    assert "s" in flags or "a" in flags or "A" in flags, flags

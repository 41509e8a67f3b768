"""The container images, checked without Docker: what they copy exists, they install as the README does,
generate the gRPC code at build time, run as a non-root user and carry a health check."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from tests.k8s.manifests import ROOT

DOCKERFILES = [ROOT / "deploy" / "infra" / "docker" / name for name in ("Dockerfile.cpu", "Dockerfile.cuda")]


def instructions(path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines()
                                         if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines() if line.strip()]


def makefile_torch() -> str:
    (version,) = re.findall(r"pip install torch==([\w.]+)", (ROOT / "Makefile").read_text())
    return version


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile(path):
    steps = instructions(path)
    kinds = [k for k, _ in steps]
    assert kinds[0] in ("ARG", "FROM") and "FROM" in kinds
    assert dict((k, v) for k, v in steps if k == "ARG" and v.startswith("TORCH_VERSION="))["ARG"] \
        == f"TORCH_VERSION={makefile_torch()}"
    runs = " && ".join(v for k, v in steps if k == "RUN")
    assert re.search(r"pip install [^&]*\"torch==\$\{TORCH_VERSION\}\"", runs)
    # the README's `make install`: torch first, then this package (here non-editable, without extras)
    assert runs.index("torch==") < runs.index("pip install --no-cache-dir .")
    assert runs.index("pip install --no-cache-dir .") < runs.index("python -m deploy.rpc.codegen")
    assert "deploy.rpc.specfleet_pb2_grpc" in runs  # the build fails unless the generated module imports
    users = [v for k, v in steps if k == "USER"]
    assert users and users[-1] not in ("root", "0") and kinds.index("USER") < kinds.index("COPY")
    assert "HEALTHCHECK" in kinds and "/health" in dict(steps)["HEALTHCHECK"]
    # the entrypoint serves: a cluster on loopback, the app on 0.0.0.0 (tests/k8s/test_container.py runs it)
    assert json.loads(dict(steps)["ENTRYPOINT"]) == ["python", "-m", "deploy.infra.container"]
    assert dict(steps)["EXPOSE"].split() == ["8000", "9000"]  # never Ray's GCS (6379) or dashboard (8265)
    for _, args in (s for s in steps if s[0] == "COPY"):
        sources = [w for w in shlex.split(args) if not w.startswith("--")][:-1]
        for src in sources:
            assert (ROOT / src).exists(), f"{path.name} copies {src}, which does not exist"
            assert not ignored(src), f"{path.name} copies {src}, but .dockerignore leaves it out"


def ignored(src: str) -> bool:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and p[0] != "#"]
    return any(src.rstrip("/") == p.rstrip("/") for p in patterns)


def test_readme_install_is_what_the_images_do():
    makefile = (ROOT / "Makefile").read_text()
    assert "make install" in (ROOT / "README.md").read_text() or "install:" in makefile
    assert makefile.index("pip install torch==") < makefile.index("pip install -e '.[test,bench]'")
    assert (ROOT / "deploy" / "rpc" / "specfleet.proto").exists() and (ROOT / "deploy" / "rpc" / "codegen.py").exists()

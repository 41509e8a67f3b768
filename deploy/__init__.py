"""Deployment: the Serve ingress (serve/), the CLI (cli/), benchmarks (bench/), cluster and image tooling (infra/)."""

from pathlib import Path

CONFIGS = Path(__file__).parent / "configs"
DEFAULT_CONFIG = CONFIGS / "default.yaml"  # the embedded default `make serve` runs
DEFAULT_INVENTORY = CONFIGS / "fleet.yaml"  # the local cluster's demo fleet

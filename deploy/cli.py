"""The `specfleet` command line: a thin layer that parses flags and hands them to one command module each."""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from actors.engine import RequestError
from actors.model.loader import ModelLoadError
from cluster.config import ConfigError
from deploy import admin_cmd, cluster_cmd, generate, k8s_cmd, serve_cmd
from deploy.bench import load as bench_load
from deploy.bench import pipeline as bench_pipeline
from deploy.bench import serve as bench_serve
from deploy.bench import spec as bench_spec
from deploy.flags import UsageError
from deploy.model_store import ModelFetchError

# Errors a user can fix from the message alone: printed without a traceback, exit status 2.
USER_ERRORS = (ConfigError, ModelLoadError, ModelFetchError, RequestError, UsageError, ValidationError, OSError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specfleet", description="Serve LLMs with lossless speculative decoding.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser("generate", help="generate offline in one process")
    generate.add_arguments(p)
    p.set_defaults(run=generate.run)

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True, metavar="BENCH")
    p = bench.add_parser("spec", help="speculative decoding vs plain decoding vs transformers' assisted generation")
    bench_spec.add_arguments(p)
    p.set_defaults(run=bench_spec.run)
    p = bench.add_parser("load", help="Poisson load at several rates for each speculation policy (off, fixed, goodput)")
    bench_load.add_arguments(p)
    p.set_defaults(run=bench_load.run)
    p = bench.add_parser("pipeline", help="one process vs the target split over 2, 3... stages on the local cluster")
    bench_pipeline.add_arguments(p)
    p.set_defaults(run=bench_pipeline.run)
    p = bench.add_parser("serve", help="load through the served app over HTTP: latency, router overhead, concurrency")
    bench_serve.add_arguments(p)

    p = commands.add_parser("serve", help="deploy the Serve application (HTTP + gRPC) onto a running cluster")
    serve_cmd.add_arguments(p)

    p = commands.add_parser("cluster", help="a local multi-node Ray cluster on this machine: up, status, down")
    cluster_cmd.add_arguments(p)  # each action sets its own `run`

    p = commands.add_parser("k8s", help="Kubernetes (KubeRay) manifests: render")
    k8s_cmd.add_arguments(p)  # each action sets its own `run`

    # the operator's commands over the served app (deploy/admin_cmd.py); each sets its own `run`
    admin_cmd.add_status(commands.add_parser("status", help="the app's health, nodes, instances, load, acceptance"))
    admin_cmd.add_instances(commands.add_parser("instances", help="the engine instances and their load"))
    admin_cmd.add_requests(commands.add_parser("requests", help="the router's request table"))
    admin_cmd.add_abort(commands.add_parser("abort", help="abort a running request"))
    admin_cmd.add_drain(commands.add_parser("drain", help="stop sending new requests to an instance"))
    admin_cmd.add_drain(commands.add_parser("undrain", help="let a drained instance take requests again"), undo=True)
    admin_cmd.add_models(commands.add_parser("models", help="the model catalog: list, fetch"))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except USER_ERRORS as e:
        print(f"specfleet: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

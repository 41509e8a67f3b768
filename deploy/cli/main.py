"""The `specfleet` command line: a thin layer that parses flags and hands them to one command module each.

Only the module of the command being run is imported (the engine's pull in torch and transformers, seconds
of start-up that `specfleet status` should not pay); `specfleet --help` imports none.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pydantic import ValidationError

from cluster.config import ConfigError
from deploy.cli.flags import UsageError
from deploy.model_store import ModelFetchError

# (command words, help, module, the module's function that adds the command's flags and sets `run`
# (or the module's `run` is used))
COMMANDS: list[tuple[tuple[str, ...], str, str, str]] = [
    (("generate",), "generate offline in one process", "deploy.cli.generate", "add_arguments"),
    (("bench", "spec"), "speculative decoding vs plain decoding vs transformers' assisted generation",
     "deploy.bench.spec", "add_arguments"),
    (("bench", "default"), "off vs fixed vs goodput for every draft kind (model, n-gram, suffix), default model and "
     "Qwen pair, batch 1 and 8", "deploy.bench.default", "add_arguments"),
    (("bench", "cpu"), "llama.cpp (if installed) vs plain and speculative decoding, weights dequantized vs stored, "
     "default model and Qwen pair", "deploy.bench.cpu", "add_arguments"),
    (("bench", "gpu"), "on a lent GPU, within 8 minutes: the lossless unit tier and the link paths on CUDA (NCCL "
     "between two GPUs), bench spec; writes the figures to docs/benchmarks.md (make gpu-check)",
     "deploy.bench.gpu", "add_arguments"),
    (("bench", "dtype"), "fp32 vs bf16 on each CPU path (our avx512 and avx2 kernels, torch's ops): prefill and "
     "decoding, the figures behind dtype: auto", "deploy.bench.dtype", "add_arguments"),
    (("bench", "load"), "Poisson load at several rates for each speculation policy (off, fixed, goodput)",
     "deploy.bench.load", "add_arguments"),
    (("bench", "pipeline"), "one process vs the target split over 2, 3... stages on the local cluster",
     "deploy.bench.pipeline", "add_arguments"),
    (("bench", "easyspec"), "sequential vs EasySpec layer-parallel drafting (group sizes, modes, calibration on/off)",
     "deploy.bench.easyspec", "add_arguments"),
    (("bench", "group-step"), "what one EasySpec group step (broadcast, layer, all-gather) costs between processes",
     "deploy.bench.group_step", "add_arguments"),
    (("bench", "migration"), "live migration's downtime (staged vs stop-and-copy) by context length, failover, and "
     "migration policies under skewed load, on the local cluster", "deploy.bench.migration", "add_arguments"),
    (("bench", "disagg"), "long-prompt interference: short requests' ITL p99 while long prompts arrive, aggregated vs "
     "prefill/decode disaggregated, on 3 local nodes", "deploy.bench.disagg", "add_arguments"),
    (("bench", "moe"), "plain expert parallelism vs Speculative MoE's expert grouping and request placement, on "
     "the local cluster", "deploy.bench.moe", "add_arguments"),
    (("bench", "faults"), "each fault (router, instance, shard, node killed; link cut or degraded; a migration's "
     "destination killed) under streaming load, on hosts in network namespaces: a row per fault",
     "deploy.bench.faults", "add_arguments"),
    (("bench", "serve"), "load through the served app over HTTP: latency, router overhead, concurrency",
     "deploy.bench.serve", "add_arguments"),
    (("bench", "attention"), "attention over the paged KV cache: gather-then-SDPA vs the whole pool, per layer",
     "deploy.bench.attention", "add_arguments"),
    (("bench", "router-sim"), "the router's dispatch and migration planning at fleet scale (1,000 simulated "
     "instances, a multi-turn trace): route() and planning latency, prefix hit rate, index memory",
     "deploy.bench.router_sim", "add_arguments"),
    (("bench", "elastic"), "a load that rises and falls against a fixed fleet of the max size, one of the min size "
     "and the autoscaled one, on the local cluster: TTFT/ITL p99 vs target, instance-seconds, streams lost",
     "deploy.bench.elastic", "add_arguments"),
    (("bench", "autoscale-sim"), "the SLO autoscaler driving a simulated fleet of up to 1,000 instances under a "
     "load stepped up then down: steps and reasons, decision latency, requests lost, instance-seconds",
     "deploy.bench.autoscale_sim", "add_arguments"),
    (("bench", "prefix"), "prefix caching off vs on with least-load vs cache-aware dispatch on a multi-turn chat "
     "workload (and a long shared system prompt), and a migration's bytes with its prefix cached, on the local cluster",
     "deploy.bench.prefix", "add_arguments"),
    (("bench", "models"), "one model on the native and the generic path side by side: the same greedy tokens in "
     "fp32, then tok/s plain and speculative (and llama.cpp if installed), batch 1", "deploy.bench.models",
     "add_arguments"),
    (("bench", "agent"), "a multi-turn tool-calling agent loop served with speculation off, n-gram and suffix, at "
     "concurrency 1 and 8", "deploy.bench.agent", "add_arguments"),
    (("bench", "start"), "a start from a fresh process to the first token, phase by phase: cold vs warm (cached)",
     "deploy.bench.start", "add_arguments"),
    (("train-moe",), "train a small MoE model on CPU for the expert-parallel benchmarks", "deploy.bench.train_moe",
     "add_arguments"),
    (("experts",), "expert parallelism: profile routing, plan and apply expert groups, status",
     "deploy.cli.experts_cmd", "add_arguments"),
    (("serve",), "deploy the Serve application (HTTP + gRPC) onto a running cluster", "deploy.cli.serve_cmd",
     "add_arguments"),
    (("cluster",), "a local multi-node Ray cluster on this machine: up, status, down", "deploy.cli.cluster_cmd",
     "add_arguments"),
    (("k8s",), "Kubernetes (KubeRay) manifests: render", "deploy.cli.k8s_cmd", "add_arguments"),
    (("status",), "the app's health, nodes, instances, load, acceptance", "deploy.cli.admin_cmd", "add_status"),
    (("instances",), "the engine instances and their load", "deploy.cli.admin_cmd", "add_instances"),
    (("requests",), "the router's request table", "deploy.cli.admin_cmd", "add_requests"),
    (("abort",), "abort a running request", "deploy.cli.admin_cmd", "add_abort"),
    (("drain",), "stop sending new requests to an instance and migrate its requests away", "deploy.cli.admin_cmd",
     "add_drain"),
    (("migrate",), "live-migrate a running request to another instance", "deploy.cli.admin_cmd", "add_migrate"),
    (("undrain",), "let a drained instance take requests again", "deploy.cli.admin_cmd", "add_undrain"),
    (("models",), "the model catalog: list, fetch", "deploy.cli.admin_cmd", "add_models"),
]
GROUPS = {"bench": "benchmarks"}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the commands `argv` names get their flags (and their modules imported). None: all."""
    words = []
    for token in argv if argv is not None else []:
        if token.startswith("-"):
            break
        words.append(token)
    parser = argparse.ArgumentParser(prog="specfleet", description="Serve LLMs with lossless speculative decoding.")
    top = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for path, help_, module, adder in COMMANDS:
        subs = top
        if len(path) == 2:
            if path[0] not in groups:
                group = top.add_parser(path[0], help=GROUPS[path[0]])
                groups[path[0]] = group.add_subparsers(dest=path[0], required=True, metavar=path[0].upper())
            subs = groups[path[0]]
        p = subs.add_parser(path[-1], help=help_)
        if argv is None or tuple(words[:len(path)]) == path:
            mod = importlib.import_module(module)
            getattr(mod, adder)(p)
            if p.get_default("run") is None and hasattr(mod, "run"):  # groups (cluster, k8s...) set it per action
                p.set_defaults(run=mod.run)
    return parser


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors a user can fix from the message alone: printed without a traceback, exit status 2."""
    errors: list[type[BaseException]] = [ConfigError, ModelFetchError, UsageError, ValidationError, OSError]
    for module, name in (("actors.engine.core", "RequestError"), ("actors.model.loader", "ModelLoadError")):
        if module in sys.modules:  # not imported: the command cannot have raised it
            errors.append(getattr(sys.modules[module], name))
    return tuple(errors)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return args.run(args)
    except user_errors() as e:
        print(f"specfleet: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

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

Command = tuple[tuple[str, ...], str, str, str]  # (command words, help, module, the function adding its flags)


def bench(name: str, help_: str) -> Command:
    """`specfleet bench NAME`: the module deploy/bench/NAME.py (dashes as underscores), its `add_arguments`."""
    return ("bench", name), help_, "deploy.bench." + name.replace("-", "_"), "add_arguments"


def admin(name: str, help_: str, adder: str) -> Command:
    """`specfleet NAME`, one of the admin API's commands (deploy/cli/admin_cmd.py), its flags added by `adder`."""
    return (name,), help_, "deploy.cli.admin_cmd", adder


# (command words, help, module, the module's function that adds the command's flags and sets `run`
# (or the module's `run` is used))
COMMANDS: list[Command] = [
    (("generate",), "generate offline in one process", "deploy.cli.generate", "add_arguments"),
    bench("spec", "speculative decoding vs plain decoding vs transformers' assisted generation"),
    bench("default", "off vs fixed vs goodput for every draft kind (model, n-gram, suffix), default model and Qwen "
          "pair, batch 1 and 8"),
    bench("lookup", "n-gram lookup drafts' acceptance by the n of their match, position by position, on the target's "
          "greedy outputs (what the planner's per-match estimate learns)"),
    bench("cpu", "llama.cpp (if installed) vs plain and speculative decoding, weights dequantized vs stored, default "
          "model and Qwen pair"),
    bench("gpu", "on a lent GPU, within 8 minutes: the lossless unit tier and the link paths on CUDA (NCCL between "
          "two GPUs), bench spec; writes the figures to docs/benchmarks.md (make gpu-check)"),
    bench("dtype", "fp32 vs bf16 on each CPU path (our avx512 and avx2 kernels, torch's ops): prefill and decoding, "
          "the figures behind dtype: auto"),
    bench("load", "Poisson load at several rates for each speculation policy (off, fixed, goodput)"),
    bench("pipeline", "one process vs the target split over 2, 3... stages on the local cluster"),
    bench("easyspec", "sequential vs EasySpec layer-parallel drafting (group sizes, modes, calibration on/off)"),
    bench("group-step", "what one EasySpec group step (broadcast, layer, all-gather) costs between processes"),
    bench("migration", "live migration's downtime (staged vs stop-and-copy) by context length, failover, and migration "
          "policies under skewed load, on the local cluster"),
    bench("disagg", "long-prompt interference: short requests' ITL p99 while long prompts arrive, aggregated vs "
          "prefill/decode disaggregated, on 3 local nodes"),
    bench("moe", "plain expert parallelism vs Speculative MoE's expert grouping and request placement, on the local "
          "cluster"),
    bench("faults", "each fault (router, instance, shard, node killed; link cut or degraded; a migration's destination "
          "killed) under streaming load, on hosts in network namespaces: a row per fault"),
    bench("serve", "load through the served app over HTTP: latency, router overhead, concurrency"),
    bench("attention", "attention over the paged KV cache: gather-then-SDPA vs the whole pool, per layer"),
    bench("router-sim", "the router's dispatch and migration planning at fleet scale (1,000 simulated instances, a "
          "multi-turn trace): route() and planning latency, prefix hit rate, index memory"),
    bench("elastic", "a load that rises and falls against a fixed fleet of the max size, one of the min size and the "
          "autoscaled one, on the local cluster: TTFT/ITL p99 vs target, instance-seconds, streams lost"),
    bench("autoscale-sim", "the SLO autoscaler driving a simulated fleet of up to 1,000 instances under a load stepped "
          "up then down: steps and reasons, decision latency, requests lost, instance-seconds"),
    bench("prefix", "prefix caching off vs on with least-load vs cache-aware dispatch on a multi-turn chat workload "
          "(and a long shared system prompt), and a migration's bytes with its prefix cached, on the local cluster"),
    bench("models", "one model on the native and the generic path side by side: the same greedy tokens in fp32, then "
          "tok/s plain and speculative (and llama.cpp if installed), batch 1"),
    bench("agent", "a multi-turn tool-calling agent loop served with speculation off, n-gram and suffix, at "
          "concurrency 1 and 8"),
    bench("start", "a start from a fresh process to the first token, phase by phase: cold vs warm (cached)"),
    (("train-moe",), "train a small MoE model on CPU for the expert-parallel benchmarks",
     "deploy.bench.train_moe", "add_arguments"),
    (("experts",), "expert parallelism: profile routing, plan and apply expert groups, status",
     "deploy.cli.experts_cmd", "add_arguments"),
    (("serve",), "deploy the Serve application (HTTP + gRPC) onto a running cluster",
     "deploy.cli.serve_cmd", "add_arguments"),
    (("cluster",), "a local multi-node Ray cluster on this machine: up, status, down",
     "deploy.cli.cluster_cmd", "add_arguments"),
    (("k8s",), "Kubernetes (KubeRay) manifests: render", "deploy.cli.k8s_cmd", "add_arguments"),
    admin("status", "the app's health, nodes, instances, load, acceptance", "add_status"),
    admin("instances", "the engine instances and their load", "add_instances"),
    admin("requests", "the router's request table", "add_requests"),
    admin("abort", "abort a running request", "add_abort"),
    admin("drain", "stop sending new requests to an instance and migrate its requests away", "add_drain"),
    admin("migrate", "live-migrate a running request to another instance", "add_migrate"),
    admin("undrain", "let a drained instance take requests again", "add_undrain"),
    admin("models", "the model catalog: list, fetch", "add_models"),
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

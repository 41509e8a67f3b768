"""`specfleet bench pipeline`: the same requests on one process vs the target split over 2, 3... stages on nodes.

Runs on the local cluster that `specfleet cluster up` started (its state file names the address and the
inventory). `--stages 1` is the single-process engine (no Ray); n > 1 builds an instance laid out by the
planner with n stages (placement/planner.py), its stage and draft actors driven by the engine in this process,
and serves the requests through it. For each run: tokens/s,
steps and the mean time per step, whether the outputs equal the first run's (lossless), and per stage
boundary the measured transfer of activations: from the sender's send start to the receiver's receive end
(one host's clock, so comparable on the local cluster), and the sender's own send time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import ray

from actors.serving.build import ray_instance
from actors.engine.core import Engine
from actors.model.loader import load_model, load_model_config
from actors.model.runner import ModelRunner
from actors.engine.offline import generate
from actors.transport.p2p import Transfer
from cluster.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculationConfig
from cluster.request import SamplingParams
from deploy.infra import local_cluster
from deploy.bench.prompts import DATASETS, load_prompts
from deploy.cli.flags import parse_numbers
from deploy.model_store import resolve_model
from placement.inventory import Inventory
from placement.layout import ShardLayout
from placement.model_size import model_size_from_config
from placement.planner import plan


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target model (catalog name, GGUF, folder)")
    p.add_argument("--draft", required=True, help="draft model sharing the target's tokenizer")
    p.add_argument("--stages", default="1,2,3", help="stage counts to run, comma-separated (1: one process)")
    p.add_argument("--prompts", type=Path, nargs="+", default=[DATASETS / "mt_bench_questions.jsonl"])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per actor")
    p.add_argument("--step-timeout", type=float, default=600.0,
                   help="seconds a stage may take for one step (and a transfer may wait) before it counts as failed")
    p.add_argument("--state", type=Path, default=local_cluster.DEFAULT_STATE, help="the local cluster's state file")
    p.add_argument("--json", type=Path)


def run(args: argparse.Namespace) -> int:
    counts = parse_numbers(args.stages, "--stages", int, "counts like 1,2,3")
    target, draft = resolve_model(args.target, args.dtype), resolve_model(args.draft, args.dtype)
    cache = CacheConfig(block_size=16, num_blocks=args.max_batch_size * (args.max_prompt_tokens + args.max_tokens
                                                                         + args.k) // 16 + 16)
    cfg = EngineConfig(model=ModelConfig(target=target, draft=draft, dtype=args.dtype),
                       speculation=SpeculationConfig(policy="fixed", k=args.k),
                       scheduler=SchedulerConfig(max_batch_size=args.max_batch_size,
                                                 max_num_batched_tokens=max(256, args.max_batch_size)),
                       cache=cache)
    tokenizer_model = load_model(target, args.dtype)
    prompts = [tokenizer_model.encode(t, chat=True)[:args.max_prompt_tokens] for t in load_prompts(args.prompts, args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    state = local_cluster.read_state(args.state) if any(n > 1 for n in counts) else None
    if state is not None:
        local_cluster.connect(state, logging_level="ERROR", log_to_driver=False)
    runs: list[dict] = []
    first: list[list[int]] | None = None
    try:
        for n in counts:
            result = _one_process(cfg, tokenizer_model, prompts, params) if n == 1 else \
                _distributed(cfg, state, n, prompts, params, args.num_cpus, args.step_timeout)
            outputs = result.pop("outputs")
            first = first if first is not None else outputs
            result["identical_to_first"] = outputs == first  # greedy: lossless means token for token
            runs.append(result)
            print(f"{n} stage(s): {result['tokens_per_s']:.1f} tok/s, {result['steps']} steps, "
                  f"{result['step_ms']:.2f} ms/step" + "".join(
                      f"; {b['from']}->{b['to']}: {b['transfer_ms_median']:.2f} ms" for b in result["boundaries"]),
                  flush=True)
    finally:
        if state is not None:
            ray.shutdown()
    report = {"target": target, "draft": draft, "num_prompts": len(prompts), "max_tokens": args.max_tokens,
              "k": args.k, "runs": runs}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def _one_process(cfg: EngineConfig, target_model, prompts, params) -> dict:
    draft_model = load_model(cfg.model.draft, cfg.model.dtype)
    engine = Engine(ModelRunner(target_model, range(target_model.num_layers), cfg.cache),
                    ModelRunner(draft_model, range(draft_model.num_layers), cfg.cache), cfg.speculation, cfg.scheduler)
    generate(engine, prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    steps0 = engine.stats().step.num_steps
    start = time.perf_counter()
    outputs = [c.token_ids for c in generate(engine, prompts, params)]
    seconds = time.perf_counter() - start
    return _result(1, ["(this process)"], outputs, seconds, engine.stats().step.num_steps - steps0, [])


def _distributed(cfg: EngineConfig, state, n: int, prompts, params, num_cpus: float, timeout_s: float) -> dict:
    inventory = Inventory(nodes=[node.spec for node in state.nodes])
    sizes = [model_size_from_config(load_model_config(p)) for p in (cfg.model.target, cfg.model.draft)]
    kv_tokens = cfg.cache.num_blocks * cfg.cache.block_size
    layout = ShardLayout.from_plan(plan(inventory, sizes[0], sizes[1], kv_tokens=kv_tokens, num_stages=n).instances[0])
    instance = ray_instance(cfg, layout, num_cpus=num_cpus, step_timeout_s=timeout_s, group_timeout_s=timeout_s)
    try:
        stages = instance.target.executor.actors
        generate(instance, prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
        steps0 = instance.stats().step.num_steps
        ray.get([s.take_transfers.remote() for s in stages])
        start = time.perf_counter()
        completions = generate(instance, prompts, params)
        seconds = time.perf_counter() - start
        steps = instance.stats().step.num_steps - steps0
        transfers = ray.get([s.take_transfers.remote() for s in stages])
    finally:
        instance.shutdown()
    nodes = [f"{s.node}[{s.layers[0]}:{s.layers[1]}]" for s in layout.stages]
    return _result(n, nodes, [c.token_ids for c in completions], seconds, steps, _boundaries(nodes, transfers))


def _boundaries(nodes: list[str], transfers: list[list[Transfer]]) -> list[dict]:
    """Per boundary b -> b+1: sends of stage b paired in order with the receives of stage b+1."""
    out = []
    for b in range(len(nodes) - 1):
        sends = [t for t in transfers[b] if t.kind == "send"]
        recvs = [t for t in transfers[b + 1] if t.kind == "recv"]
        pairs = list(zip(sends, recvs))
        lat = sorted((r.ended - s.started) * 1e3 for s, r in pairs)
        out.append({
            "from": nodes[b], "to": nodes[b + 1], "transfers": len(pairs),
            "transfer_ms_median": statistics.median(lat) if lat else 0.0,
            "transfer_ms_p90": lat[int(0.9 * (len(lat) - 1))] if lat else 0.0,
            "send_ms_median": statistics.median(s.seconds * 1e3 for s, _ in pairs) if pairs else 0.0,
            "mean_bytes": statistics.mean(s.nbytes for s, _ in pairs) if pairs else 0,
        })
    return out


def _result(n: int, nodes: list[str], outputs: list[list[int]], seconds: float, steps: int,
            boundaries: list[dict]) -> dict:
    tokens = sum(len(o) for o in outputs)
    return {"stages": n, "layout": nodes, "tokens": tokens, "seconds": round(seconds, 4),
            "tokens_per_s": tokens / seconds if seconds else 0.0, "steps": steps,
            "step_ms": seconds / steps * 1e3 if steps else 0.0, "boundaries": boundaries,
            "outputs": outputs}

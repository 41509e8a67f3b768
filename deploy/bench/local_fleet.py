"""What the benchmarks on the local cluster's instances share: their flags, the cluster's nodes, a fleet of instances
with a router actor and the API's own frontend in this process (`Bench`), the streams it measures, and real text.

`specfleet bench migration`, `disagg`, `elastic` and `prefix` drive instances through the frontend as the served app
does (deploy/serve/frontend.py: its streams follow a migrated request and fail over a dead instance's).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray

from actors.serving.server import InstanceServer
from cluster.config import EngineConfig, RouterConfig, SpecfleetConfig
from cluster.disagg import Role
from cluster.router import Router
from deploy.bench.prompts import DATASETS, load_prompts
from deploy.cli.flags import UsageError
from deploy.infra import local_cluster
from deploy.serve.frontend import Frontend
from deploy.serve.frontend_config import frontend_config
from placement.fleet import InstanceSpec
from placement.layout import ShardLayout, StageSlot


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="target model (catalog name, GGUF, folder)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")


def add_cluster_flags(p: argparse.ArgumentParser, cpus_help: str = "CPUs per instance") -> None:
    """--num-cpus (of each instance), the local cluster's --state file, and --json for the report."""
    p.add_argument("--num-cpus", type=float, default=1.0, help=cpus_help)
    p.add_argument("--state", type=Path, default=local_cluster.DEFAULT_STATE, help="the local cluster's state file")
    p.add_argument("--json", type=Path)


def local_nodes(state_file: Path, command: str, need: int, why: str) -> list[str]:
    """The local cluster's node names, connected to (quietly); UsageError if it has fewer than `need` (`why`: what
    `command` runs on them)."""
    state = local_cluster.read_state(state_file)
    nodes = [n.spec.name for n in state.nodes]
    if len(nodes) < need:
        raise UsageError(f"bench {command} needs {need} nodes ({why}); the local cluster has {len(nodes)}: "
                         f"`specfleet cluster up --nodes {need}`")
    local_cluster.connect(state, logging_level="ERROR", log_to_driver=False)
    return nodes


@dataclass
class Streamed:
    """One client stream: its tokens, when each delta arrived, and where it ended."""

    tokens: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # perf_counter of each token-bearing delta
    start: float = 0.0
    finish: str | None = None
    error: str | None = None
    instance: str = ""
    side: object = None  # what `during` returned

    @property
    def ttft_s(self) -> float:
        return self.arrivals[0] - self.start

    def gaps_after(self, t: float) -> list[float]:
        """Waits between consecutive deltas, counting those that end after `t`."""
        times = [self.start] + self.arrivals
        return [b - a for a, b in zip(times, times[1:]) if b > t]


class Bench:
    """Instances on the local cluster's nodes, a router and a frontend in this process."""

    def __init__(self, cfg: EngineConfig, num_layers: int, num_cpus: float, router_cfg: RouterConfig,
                 nodes: list[str] | None = None, stages: int = 1) -> None:
        self.cfg, self.num_layers, self.num_cpus = cfg, num_layers, num_cpus
        self.nodes, self.stages = nodes or [], stages
        self.router = ray.remote(Router).options(num_cpus=0, max_concurrency=1000).remote(router_cfg)
        self.frontend = Frontend(frontend_config(SpecfleetConfig(engine=cfg)), self.router)
        self.servers: dict[str, ray.actor.ActorHandle] = {}

    def start(self, instance_id: str, node: str, shift: int = 0, role: Role = "both") -> None:
        """An instance whose first stage is on `node`: the whole model in its actor, or (`stages` > 1) that many
        shard actors on consecutive nodes, each stage boundary `shift` layers later than an even split; registered
        with `role` (cluster/disagg.py)."""
        if self.stages == 1:
            layout = ShardLayout(stages=(StageSlot(node=node, layers=(0, self.num_layers)),))
        else:
            n, k, first = self.num_layers, self.stages, self.nodes.index(node)
            cuts = [0] + [min(n - 1, i * n // k + shift) for i in range(1, k)] + [n]
            layout = ShardLayout(stages=tuple(StageSlot(node=self.nodes[(first + i) % len(self.nodes)],
                                                        layers=(cuts[i], cuts[i + 1])) for i in range(k)))
        spec = InstanceSpec(instance_id=instance_id, layout=layout, executor="local" if self.stages == 1 else "ray",
                            num_cpus=self.num_cpus / self.stages, engine=self.cfg, step_timeout_s=600)
        began = time.monotonic()
        server = InstanceServer.spawn(spec)
        info = ray.get(server.info.remote(), timeout=600)
        # its start, as a deployed replica reports it: the router learns how long a start takes (the failover wait,
        # the autoscaler's predictive step up: cluster/start_times.py)
        ray.get(self.router.register.remote(instance_id, server, info.model, info.max_model_len, info.node_id,
                                            start_s=time.monotonic() - began, role=role))
        self.servers[instance_id] = server

    def close(self) -> None:
        for server in self.servers.values():
            ray.kill(server)
        ray.kill(self.router)

    async def stream(self, prompt: list[int], max_tokens: int, *, after: int | None = None, during=None) -> Streamed:
        """One greedy completion; once `after` tokens have arrived, `during(request_id, instance_id)` is started
        beside the stream (which keeps being read)."""
        prep = self.frontend.prepare(prompt, max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=0, seed=None,
                                     stop=(), n=1, priority=0, ignore_eos=True)
        out = Streamed(start=time.perf_counter())
        call = await self.frontend.start(prep)
        side = None
        async for _, item in call:
            if item.delta.token_ids:
                out.tokens += item.delta.token_ids
                out.arrivals.append(time.perf_counter())
            if item.delta.finished:
                out.finish, out.error = item.delta.finish_reason.value, item.delta.error
            if during is not None and after is not None and len(out.tokens) >= after and side is None:
                side = asyncio.get_running_loop().create_task(during(prep.request_id, call.routed[0][0]))
        out.instance = call.routed[0][0]
        if side is not None:
            out.side = await side
        return out


def long_prompt(tokenizer_model, length: int) -> list[int]:
    """`length` tokens of real text: MT-Bench questions one after another, repeated as needed."""
    ids: list[int] = []
    texts = load_prompts([DATASETS / "mt_bench_questions.jsonl"], 80)
    while len(ids) < length:
        for t in texts:
            ids += tokenizer_model.encode(t)
    return ids[:length]

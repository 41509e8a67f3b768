"""`specfleet bench prefix`: prefix caching and cache-aware routing on instances of the local cluster, side by side.

A multi-turn chat workload from MT-Bench's two-turn questions: conversations start with Poisson arrivals; each
conversation's second turn is sent when its first answer is done (after `--think-s`), and repeats the first turn's
prompt and answer token for token (as a client sending the chat back). A second variant puts one long system prompt
(`--system-prompt-tokens` of real text) before every conversation. Each variant runs, with the same arrivals, on
fresh instances (cold caches) in three modes:

  (a) off          prefix caching off, least-load dispatch
  (b) least_load   prefix caching on, least-load dispatch
  (c) cache_aware  prefix caching on, cache-aware dispatch (cluster/dispatch.py)

Figures per mode: time to first token p50/p99 of first and second turns, generated tokens per second over the run,
and the prefix cache hit rate (prompt tokens found cached over prompt tokens looked up, every instance). Every
output must be the same in the three modes (temperature 0): the run fails if not. Then a migration of a request
whose long prefix the destination caches, against the same request under another `cache_salt` (nothing cached
anywhere): the target KV bytes each migration moved.

`--single N` also measures what caching costs one request on its own in the default app's engine (`--config`, in
this process): N distinct MT-Bench prompts one at a time, caching off and on in turn, time to first token and
decode tokens/s (nothing is found cached: the cost of naming and keeping blocks), then the same prompts again with
caching on (found cached).

Streams go through the API's own frontend (deploy/serve/frontend.py) to a router actor, as in `bench migration`.
Run `specfleet cluster up --nodes 3` first (with `--state` for a private cluster). Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray

from actors.serving.server import InstanceServer
from actors.model.loader import load_metadata
from cluster.config import (CacheConfig, EngineConfig, MigrationConfig, ModelConfig, RouterConfig, SchedulerConfig,
                            SpecfleetConfig, SpeculationConfig)
from cluster.router import Router
from deploy.bench.local_fleet import long_prompt
from deploy.bench.output import pct, save
from deploy import DEFAULT_CONFIG, model_store
from deploy.bench.prompts import DATASETS, load_prompts
from deploy.cli.flags import UsageError
from deploy.infra import local_cluster
from deploy.model_store import resolve_model
from deploy.serve.frontend import Frontend
from deploy.serve.frontend_config import frontend_config
from placement.fleet import InstanceSpec
from placement.layout import ShardLayout, StageSlot

MODES = {"off": (False, "least_load"), "least_load": (True, "least_load"), "cache_aware": (True, "cache_aware")}
ANSWER = "\x00ANSWER\x00"  # where the first answer goes in the rendered chat (cut out: the answer goes as tokens)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="target model (catalog name, GGUF, folder)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="fp32 (default): outputs must agree token for token across the modes, and bf16 is not "
                        "batch-invariant here (docs/determinism.md)")
    p.add_argument("--conversations", type=int, default=24, help="two-turn conversations per variant")
    p.add_argument("--rate", type=float, default=1.0, help="conversations started per second (Poisson)")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens each answer generates at most")
    p.add_argument("--think-s", type=float, default=0.0, help="pause between a first answer and the second turn")
    p.add_argument("--system-prompt-tokens", type=int, default=1024, help="the system-prompt variant's shared prefix")
    p.add_argument("--variants", default="mtbench,system", help="mtbench, system (comma-separated)")
    p.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)} (comma-separated)")
    p.add_argument("--instances", type=int, default=3)
    p.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per instance")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=512, help="KV blocks per instance")
    p.add_argument("--migration-tokens", type=int, default=48,
                   help="tokens the migrated request generates (0: skip the migration part)")
    p.add_argument("--single", type=int, default=0,
                   help="prompts of the single-request part in the default app's engine (0: skip it)")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the single-request part's app config")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--state", type=Path, default=local_cluster.DEFAULT_STATE, help="the local cluster's state file")
    p.add_argument("--json", type=Path)


@dataclass
class Turn:
    """One request of a conversation as it went: when it was sent, when its first token came, its tokens."""

    sent: float
    first: float | None = None
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None

    @property
    def ttft_s(self) -> float:
        return (self.first or float("nan")) - self.sent


class Fleet:
    """`instances` instances (one per node) of one engine config, a router actor and the API's frontend."""

    def __init__(self, cfg: EngineConfig, router_cfg: RouterConfig, nodes: list[str], instances: int,
                 num_layers: int, num_cpus: float) -> None:
        self.router = ray.remote(Router).options(num_cpus=0, max_concurrency=1000).remote(router_cfg)
        self.frontend = Frontend(frontend_config(SpecfleetConfig(engine=cfg, router=router_cfg)), self.router)
        self.servers: dict[str, ray.actor.ActorHandle] = {}
        for i in range(instances):
            node = nodes[i % len(nodes)]
            layout = ShardLayout(stages=(StageSlot(node=node, layers=(0, num_layers)),))
            spec = InstanceSpec(instance_id=f"prefix-{i}", layout=layout, executor="local", num_cpus=num_cpus,
                                engine=cfg, step_timeout_s=600)
            self.servers[spec.instance_id] = InstanceServer.spawn(spec)
        infos = ray.get([s.info.remote() for s in self.servers.values()], timeout=900)  # they load side by side
        for (instance_id, server), info in zip(self.servers.items(), infos):
            ray.get(self.router.register.remote(instance_id, server, info.model, info.max_model_len, info.node_id))

    def close(self) -> None:
        for server in self.servers.values():
            ray.kill(server)
        ray.kill(self.router)

    async def turn(self, prompt: list[int], max_tokens: int, cache_salt: str | None = None, ignore_eos: bool = False,
                   after: int = 0, during=None) -> tuple[Turn, object]:
        """One greedy completion; once `after` tokens came, `during(request id, instance id)` runs beside it."""
        prep = self.frontend.prepare(prompt, max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=0, seed=None,
                                     stop=(), n=1, priority=0, cache_salt=cache_salt, ignore_eos=ignore_eos)
        t = Turn(time.perf_counter())
        call = await self.frontend.start(prep)
        side = None
        async for _, item in call:
            if item.delta.token_ids:
                t.first = t.first or time.perf_counter()
                t.tokens += item.delta.token_ids
            if item.delta.finished:
                t.finish, t.error = item.delta.finish_reason.value, item.delta.error
            if during is not None and side is None and len(t.tokens) >= after:
                side = asyncio.get_running_loop().create_task(during(prep.request_id, call.routed[0][0]))
        return t, (await side if side is not None else None)

    def cache_figures(self) -> tuple[int, int]:
        """(prompt tokens looked up, found cached) over every instance since it started."""
        stats = ray.get([s.stats.remote() for s in self.servers.values()], timeout=60)
        return sum(s.prefix_cache.queries for s in stats), sum(s.prefix_cache.hits for s in stats)


class Chats:
    """The workload's prompts as token ids: a conversation's first turn, and its second once the first answer is
    known (the first prompt, the answer's tokens, then the chat template's continuation and the second question)."""

    def __init__(self, tokenizer, system: str | None) -> None:
        self.tok, self.system = tokenizer, system

    def _render(self, messages: list[dict]) -> str:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return self.tok.apply_chat_template(head + messages, add_generation_prompt=True, tokenize=False)

    def first(self, turns: list[str]) -> list[int]:
        return self.tok.encode(self._render([{"role": "user", "content": turns[0]}]), add_special_tokens=False)

    def second(self, turns: list[str], first: list[int], answer: list[int]) -> list[int]:
        text = self._render([{"role": "user", "content": turns[0]}, {"role": "assistant", "content": ANSWER},
                             {"role": "user", "content": turns[1]}])
        rest = text.split(ANSWER, 1)[1]
        return first + answer + self.tok.encode(rest, add_special_tokens=False)


async def workload(fleet: Fleet, chats: Chats, questions: list[list[str]], gaps: list[float],
                   args) -> tuple[list[tuple[Turn, Turn]], float]:
    """Every conversation, arriving after `gaps`; (first turn, second turn) each, and the run's length in s."""

    async def conversation(turns: list[str]) -> tuple[Turn, Turn]:
        first = chats.first(turns)
        one, _ = await fleet.turn(first, args.max_tokens)
        await asyncio.sleep(args.think_s)
        two, _ = await fleet.turn(chats.second(turns, first, one.tokens), args.max_tokens)
        return one, two

    t0 = time.perf_counter()
    tasks = []
    for turns, gap in zip(questions, gaps):
        await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(conversation(turns)))
    done = await asyncio.gather(*tasks)
    return done, time.perf_counter() - t0


def run_mode(mode: str, args, target: str, tok, nodes: list[str], chats: Chats, questions, gaps) -> dict:
    caching, dispatch = MODES[mode]
    cfg = EngineConfig(model=ModelConfig(target=target, dtype=args.dtype), speculation=SpeculationConfig(policy="off"),
                       scheduler=SchedulerConfig(max_batch_size=8, max_num_batched_tokens=256),
                       cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                                         prefix_caching=caching))
    fleet = Fleet(cfg, RouterConfig(dispatch=dispatch, stats_interval_s=0.2), nodes, args.instances,
                  tok.config.num_hidden_layers, args.num_cpus)
    try:
        for server in fleet.servers.values():  # warm-up, outside the figures: a prompt nothing else starts with
            warm = tok.encode("warm up " * 8)
            asyncio.run(_direct(server, warm, 4))
        queries0, hits0 = fleet.cache_figures()
        done, seconds = asyncio.run(workload(fleet, chats, questions, gaps, args))
        queries, hits = fleet.cache_figures()
        figures = _figures(mode, done, seconds, (hits - hits0) / max(1, queries - queries0))
        figures["decisions"] = ray.get(fleet.router.routing_stats.remote()).decisions
        migration = _migration(fleet, chats, args) if mode == "cache_aware" and args.migration_tokens else None
    finally:
        fleet.close()
    return {**figures, "migration": migration, "outputs": [[a.tokens, b.tokens] for a, b in done]}


async def _direct(server, prompt: list[int], max_tokens: int, rid: str | None = None) -> list[int]:
    """A request sent to an instance itself (warm-up, or filling its cache for the migration part)."""
    from cluster.request import Request, SamplingParams

    request = Request(rid or f"direct-{random.getrandbits(64):x}", tuple(prompt),
                      SamplingParams(temperature=0.0, max_tokens=max_tokens))
    tokens = []
    async for ref in server.generate.options(num_returns="streaming").remote(request):
        tokens += (await ref).delta.token_ids
    return tokens


def _figures(mode: str, done: list[tuple[Turn, Turn]], seconds: float, hit_rate: float) -> dict:
    firsts, seconds_ = [a for a, _ in done], [b for _, b in done]
    errors = [t.error for t in firsts + seconds_ if t.error]
    if errors:
        raise RuntimeError(f"{mode}: {len(errors)} requests failed, e.g. {errors[0]}")
    ms = lambda ts, q: round(1e3 * pct([t.ttft_s for t in ts], q), 1)  # noqa: E731
    return {"mode": mode, "requests": 2 * len(done), "ttft1_ms_p50": ms(firsts, 50), "ttft1_ms_p99": ms(firsts, 99),
            "ttft2_ms_p50": ms(seconds_, 50), "ttft2_ms_p99": ms(seconds_, 99),
            "tok_s": round(sum(len(t.tokens) for t in firsts + seconds_) / seconds, 2), "seconds": round(seconds, 1),
            "hit_rate": round(hit_rate, 4)}


def _migration(fleet: Fleet, chats: Chats, args) -> dict:
    """A request whose long prefix (the system prompt, or the chat template's head) every other instance caches is
    migrated mid-stream, then the same request under a salt nothing is cached for: target KV bytes moved."""
    question = ["Summarize the previous answer in three bullet points.", "Thanks."]
    prompt = chats.first(question)
    for i, server in enumerate(fleet.servers.values()):  # each caches the shared head (another question after it)
        asyncio.run(_direct(server, chats.first([f"Question number {i}: what is a prime number?", ""]), 2))
    alone, _ = asyncio.run(fleet.turn(prompt, args.migration_tokens, ignore_eos=True))
    rows = {}
    for name, salt in (("cached", None), ("cold", "bench-cold")):
        async def move(rid: str, instance: str):
            to = next(n for n in fleet.servers if n != instance)
            return await fleet.router.migrate.remote(rid, to, MigrationConfig())

        t, r = asyncio.run(fleet.turn(prompt, args.migration_tokens, cache_salt=salt, ignore_eos=True, after=8,
                                      during=move))
        rows[name] = {"status": r.status.value, "reason": r.reason, "tokens_copied": r.tokens_copied,
                      "tokens_skipped": r.tokens_skipped,
                      "bytes_copied": r.bytes_copied, "bytes_skipped": r.bytes_skipped,
                      "downtime_ms": round(r.downtime_s * 1e3, 2), "identical": t.tokens == alone.tokens}
    cached, cold = rows["cached"], rows["cold"]
    saved = 1 - cached["bytes_copied"] / cold["bytes_copied"] if cold["bytes_copied"] else None
    return {"prompt_tokens": len(prompt), **rows, "bytes_saved": None if saved is None else round(saved, 4)}


def run(args: argparse.Namespace) -> int:
    variants = [v for v in args.variants.split(",") if v]
    modes = [m for m in args.modes.split(",") if m]
    if not set(variants) <= {"mtbench", "system"} or not variants and not args.single:
        raise UsageError(f"--variants: choose from mtbench, system (none only with --single); got {args.variants!r}")
    if not set(modes) <= set(MODES) or not modes:
        raise UsageError(f"--modes: choose from {', '.join(MODES)}; got {args.modes!r}")
    rows = [json.loads(line) for line in (DATASETS / "mt_bench_questions.jsonl").read_text().splitlines() if line]
    if args.conversations > len(rows):
        raise UsageError(f"--conversations: MT-Bench has {len(rows)} two-turn questions")
    report: dict = {"model": args.model, "dtype": args.dtype, "instances": args.instances, "rate": args.rate,
                    "conversations": args.conversations, "max_tokens": args.max_tokens, "variants": {}}
    if args.single:
        report["single"] = single_request(args)
    if variants:
        questions = [r["turns"][:2] for r in rows[:args.conversations]]
        rng = random.Random(args.seed)
        gaps = [0.0] + [rng.expovariate(args.rate) for _ in questions[1:]]  # the same arrivals in every mode
        state = local_cluster.read_state(args.state)
        local_cluster.connect(state, logging_level="ERROR", log_to_driver=False)
        try:
            target = resolve_model(args.model, args.dtype)
            tok = load_metadata(target, args.dtype)
            for variant in variants:
                system = long_text(tok.tokenizer, args.system_prompt_tokens) if variant == "system" else None
                chats = Chats(tok.tokenizer, system)
                runs = {m: run_mode(m, args, target, tok, [n.spec.name for n in state.nodes], chats, questions, gaps)
                        for m in modes}
                report["variants"][variant] = _compare(variant, runs)
        finally:
            ray.shutdown()
    save(report, args.json, None, lambda *_: None)
    return 0 if all(v["identical"] for v in report["variants"].values()) else 1


def single_request(args) -> dict:
    """One request at a time in the default app's engine, in this process: prefix caching off vs on (alternating,
    nothing cached: what naming and keeping blocks costs), then on again with the same prompts (found cached)."""
    from actors.engine.core import Engine
    from cluster.config import load_config
    from cluster.request import Request, SamplingParams
    from deploy.serve.fleet import resolved

    cfg = resolved(load_config(args.config).engine)
    engines = {on: Engine.from_config(cfg.model_copy(update={"cache": cfg.cache.model_copy(
        update={"prefix_caching": on})}), calibration_dir=model_store.calibration_dir()) for on in (False, True)}
    prompts = [engines[False].encode(t, chat=True) for t in load_prompts([DATASETS / "mt_bench_questions.jsonl"],
                                                                          args.single)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows: dict[str, list[tuple[float, float]]] = {"off": [], "on": [], "on_cached": []}

    def one(engine: Engine, prompt: list[int], rid: str) -> tuple[float, float]:
        engine.add_request(Request(rid, tuple(prompt), params))
        t0, first, n = time.perf_counter(), None, 0
        while engine.has_unfinished():
            for d in engine.step():
                n += len(d.token_ids)
                first = first or (time.perf_counter() if d.token_ids else None)
        return first - t0, (n - 1) / (time.perf_counter() - first)

    for i, prompt in enumerate(prompts):
        for on in ((False, True) if i % 2 else (True, False)):
            rows["on" if on else "off"].append(one(engines[on], prompt, f"single-{i}-{on}"))
    for i, prompt in enumerate(prompts):
        rows["on_cached"].append(one(engines[True], prompt, f"again-{i}"))
    out = {k: {"ttft_ms_p50": round(1e3 * pct([t for t, _ in v], 50), 2),
               "tok_s_p50": round(pct([r for _, r in v], 50), 2)} for k, v in rows.items()}
    out["config"], out["prompts"] = str(args.config), len(prompts)
    print(f"single requests in the default app's engine ({cfg.model.dtype}, {len(prompts)} prompts x "
          f"{args.max_tokens} tokens): TTFT p50 off {out['off']['ttft_ms_p50']} ms, on {out['on']['ttft_ms_p50']} ms, "
          f"on and cached {out['on_cached']['ttft_ms_p50']} ms; decode tok/s p50 off {out['off']['tok_s_p50']}, on "
          f"{out['on']['tok_s_p50']}", flush=True)
    return out


def long_text(tokenizer, tokens: int) -> str:
    """MT-Bench questions one after another, about `tokens` tokens of them: the system-prompt variant's text."""
    return tokenizer.decode(long_prompt(tokenizer, tokens), skip_special_tokens=True)


def _compare(variant: str, runs: dict[str, dict]) -> dict:
    outputs = [r.pop("outputs") for r in runs.values()]
    identical = all(o == outputs[0] for o in outputs)
    out = {"runs": runs, "identical": identical}
    if "off" in runs and "cache_aware" in runs:
        out["ttft2_p50_off_over_cache_aware"] = round(runs["off"]["ttft2_ms_p50"] / runs["cache_aware"]["ttft2_ms_p50"],
                                                      2)
    if "least_load" in runs and "cache_aware" in runs and runs["least_load"]["hit_rate"]:
        out["hit_rate_cache_aware_over_least_load"] = round(
            runs["cache_aware"]["hit_rate"] / runs["least_load"]["hit_rate"], 2)
    print(f"variant {variant}: outputs identical across {', '.join(runs)}: {identical}")
    print(f"  {'mode':<12} {'TTFT1 p50':>9} {'p99':>7} {'TTFT2 p50':>9} {'p99':>7} {'tok/s':>7} {'hit rate':>8}  "
          "decisions")
    for r in runs.values():
        print(f"  {r['mode']:<12} {r['ttft1_ms_p50']:>9.0f} {r['ttft1_ms_p99']:>7.0f} {r['ttft2_ms_p50']:>9.0f} "
              f"{r['ttft2_ms_p99']:>7.0f} {r['tok_s']:>7.1f} {r['hit_rate']:>8.3f}  {r['decisions']}")
    print(f"  second-turn TTFT p50, off / cache_aware: {out.get('ttft2_p50_off_over_cache_aware')}x (goal >= 3); "
          f"hit rate, cache_aware / least_load: {out.get('hit_rate_cache_aware_over_least_load')}x (goal >= 1.5)")
    if m := runs.get("cache_aware", {}).get("migration"):
        if m["bytes_saved"] is None:
            print(f"  migration: did not finish: {m}", flush=True)
        else:
            print(f"  migration of a {m['prompt_tokens']}-token request: {m['cached']['bytes_copied']} target KV "
                  f"bytes with its prefix cached at the destination ({m['cached']['tokens_skipped']} tokens not "
                  f"copied) vs {m['cold']['bytes_copied']} under another cache_salt: {m['bytes_saved']:.1%} fewer "
                  f"(goal >= 50%); outputs identical {m['cached']['identical'] and m['cold']['identical']}",
                  flush=True)
    return out

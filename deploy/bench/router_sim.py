"""`specfleet bench router-sim`: the router's dispatch and migration planning at fleet scale, simulated.

The dispatch policies, the prefix index and the migration planner are pure code (cluster/), so this drives the
real `Registry`, `PrefixIndex` and `Planner` with plain data: a fleet of simulated instances, each with a KV
block budget, a batch limit and an LRU prefix cache, serving a multi-turn trace built from MT-Bench's two-turn
questions (each conversation's second turn is sent when its first answer is done, and repeats the first turn
and its answer). Time is simulated; what is measured is real: the wall time of every `route()` call and of
every planning round at the fleet's size, and the index's memory. Instances report stats and cache events
every `poll_s`, as the router polls real instances.

Goals (issue: the router at scale): p99 route() under 1 ms and a planning round under Llumnix's 50 ms period at
1,000 instances.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import time
import tracemalloc
import zlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from pathlib import Path

from cluster.dispatch import make_dispatch
from cluster.migration_policy import InstanceLoad, RequestLoad, make_planner
from cluster.prefix import block_hashes, root_hash
from cluster.prefix_index import CacheEvents, PrefixIndex
from cluster.registry import Registry
from cluster.request import RequestStatus
from cluster.stats import EngineStats, LoadStats, StepStats
from deploy.bench.output import save
from deploy.bench.prompts import DATASETS

VOCAB = 32_000
MODEL = "sim-model"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instances", type=int, default=1000)
    p.add_argument("--conversations", type=int, default=6000, help="two-turn conversations in the trace")
    p.add_argument("--rate", type=float, default=0.0,
                   help="conversations started per simulated second (default: 60%% of the fleet's capacity)")
    p.add_argument("--policies", nargs="+", default=["least_load", "cache_aware"])
    p.add_argument("--system-prompt-tokens", type=int, default=0,
                   help="a system prompt shared by every conversation (the long-shared-prefix variant)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per instance")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--poll-s", type=float, default=0.5, help="stats and cache events reach the router this often")
    p.add_argument("--plan-s", type=float, default=1.0, help="a migration planning round this often")
    p.add_argument("--index-max-entries", type=int, default=1_000_000)
    p.add_argument("--drain", type=float, default=0.01,
                   help="share of the instances drained halfway through (planning then moves their requests)")
    p.add_argument("--questions", type=Path, default=DATASETS / "mt_bench_questions.jsonl")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)


# ---- the trace -------------------------------------------------------------------------------------------
def _tokens(text: str) -> list[int]:
    """A stable stand-in for a tokenizer: one id per word (the simulation needs identity, not meaning)."""
    return [zlib.crc32(w.encode()) % VOCAB for w in text.split()]


@dataclass(frozen=True)
class Turn:
    conversation: int
    turn: int  # 0 or 1
    prompt: tuple[int, ...]
    output: tuple[int, ...]  # what the model answers (the next turn's prompt repeats a first turn's answer)

    @property
    def output_tokens(self) -> int:
        return len(self.output)


def conversations(questions: Path, n: int, system_tokens: int, rng: random.Random) -> list[tuple[Turn, Turn]]:
    """`n` two-turn conversations over MT-Bench's questions (its 80, reused with a per-user opening), each turn's
    prompt the whole conversation so far."""
    qs = [json.loads(line)["turns"] for line in questions.read_text().splitlines() if line.strip()]
    system = [rng.randrange(VOCAB) for _ in range(system_tokens)]
    out = []
    for c in range(n):
        first, second = qs[c % len(qs)][:2]
        user = [rng.randrange(VOCAB) for _ in range(8)]  # who asks: conversations differ after the system prompt
        p1 = system + user + _tokens(first)
        answer = [rng.randrange(VOCAB) for _ in range(rng.randint(64, 384))]
        p2 = p1 + answer + _tokens(second)
        answer2 = tuple(rng.randrange(VOCAB) for _ in range(rng.randint(64, 384)))
        out.append((Turn(c, 0, tuple(p1), tuple(answer)), Turn(c, 1, tuple(p2), answer2)))
    return out


# ---- the fleet ---------------------------------------------------------------------------------------------
PREFILL_S_PER_TOKEN = 0.0002  # a GPU-class instance: 5k prefill tokens/s per request
DECODE_S_PER_TOKEN = 0.02


@dataclass
class SimRequest:
    rid: str
    turn: Turn
    hashes: list[int]
    arrival: float
    instance: str = ""
    cached_tokens: int = 0
    start: float | None = None
    end: float | None = None


@dataclass
class SimInstance:
    """An instance: a batch of at most `max_batch` requests within its KV blocks, a FIFO queue, an LRU cache."""

    instance_id: str
    num_blocks: int
    block_size: int
    max_batch: int
    running: dict[str, SimRequest] = field(default_factory=dict)
    queue: deque = field(default_factory=deque)
    cache: OrderedDict = field(default_factory=OrderedDict)  # block hash -> None, least recently used first
    seq: int = 0
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)

    def blocks(self, r: SimRequest) -> int:
        return -(-(len(r.turn.prompt) + r.turn.output_tokens) // self.block_size)

    def used(self) -> int:
        return sum(self.blocks(r) for r in self.running.values())

    def can_start(self, r: SimRequest) -> bool:
        return len(self.running) < self.max_batch and self.used() + self.blocks(r) <= self.num_blocks

    def start(self, r: SimRequest, now: float) -> float:
        """Start `r`; its end time (its uncached prompt is prefilled, then each output token decoded)."""
        hit = 0
        for h in r.hashes:
            if h not in self.cache:
                break
            self.cache.move_to_end(h)
            hit += 1
        r.cached_tokens = hit * self.block_size
        r.start = now
        self.running[r.rid] = r
        uncached = len(r.turn.prompt) - r.cached_tokens
        return now + uncached * PREFILL_S_PER_TOKEN + r.turn.output_tokens * DECODE_S_PER_TOKEN

    def finish(self, r: SimRequest, full: list[int]) -> None:
        """`r` is done: its prompt's and output's full blocks stay cached (least recently used go first)."""
        del self.running[r.rid]
        for h in full:
            if h not in self.cache:
                self.stored.append(h)
            self.cache[h] = None
            self.cache.move_to_end(h)
        cached_budget = max(self.num_blocks - self.used(), 0)
        while len(self.cache) > cached_budget:
            h, _ = self.cache.popitem(last=False)
            self.removed.append(h)

    def events(self) -> CacheEvents:
        self.seq += 1
        batch = CacheEvents(self.seq, tuple(self.stored), tuple(self.removed), snapshot=self.seq == 1)
        self.stored, self.removed = [], []
        return batch

    def stats(self) -> EngineStats:
        used = self.used()
        return EngineStats(LoadStats(running=len(self.running), waiting=len(self.queue), kv_blocks_used=used,
                                     kv_blocks_free=self.num_blocks - used),
                           StepStats(batch_size=len(self.running)))

    def load(self) -> InstanceLoad:
        bs = self.block_size
        running = tuple(RequestLoad(r.rid, self.blocks(r), 0, len(r.turn.prompt)) for r in self.running.values())
        waiting = tuple(RequestLoad(r.rid, -(-len(r.turn.prompt) // bs), 0, len(r.turn.prompt)) for r in self.queue)
        return InstanceLoad(self.instance_id, self.num_blocks, running, waiting, max_running=self.max_batch)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def simulate(args: argparse.Namespace, policy: str, trace: list[tuple[Turn, Turn]], seed: int) -> dict:
    """Run the trace through a fleet routed by `policy`; the measured figures."""
    rng = random.Random(seed)
    registry = Registry(make_dispatch(policy), keep_finished=1000,
                        prefix=PrefixIndex(max_entries=args.index_max_entries))
    fleet = {f"i{n}": SimInstance(f"i{n}", args.num_blocks, args.block_size, args.max_batch)
             for n in range(args.instances)}
    for i in fleet:
        registry.register(i, MODEL, "node", 0.0)
    planner = make_planner(["drain", "queue", "defrag", "balance"])
    root = root_hash(MODEL)
    mean_s = sum(len(t.prompt) * PREFILL_S_PER_TOKEN + t.output_tokens * DECODE_S_PER_TOKEN
                 for c in trace for t in c) / (2 * len(trace))
    rate = args.rate or 0.6 * args.instances * args.max_batch / mean_s / 2  # conversations/s: 60% of capacity
    events: list[tuple[float, int, str, object]] = []  # (time, tiebreak, kind, payload)
    tick = iter(range(10**12))
    t = 0.0
    for conv in trace:
        t += rng.expovariate(rate)
        heapq.heappush(events, (t, next(tick), "arrive", conv[0]))
    heapq.heappush(events, (args.poll_s, next(tick), "poll", None))
    heapq.heappush(events, (args.plan_s, next(tick), "plan", None))
    heapq.heappush(events, (t / 2, next(tick), "drain", None))
    route_s, plan_s, hits, prompt_tokens, ttft = [], [], 0, 0, []
    by_id: dict[str, SimRequest] = {}
    second: dict[int, Turn] = {c[0].conversation: c[1] for c in trace}
    left, moved, draining = 2 * len(trace), 0, set()

    def try_start(inst: SimInstance, now: float) -> None:
        while inst.queue and inst.can_start(inst.queue[0]):
            r = inst.queue.popleft()
            heapq.heappush(events, (inst.start(r, now), next(tick), "finish", r))
            ttft.append(r.start - r.arrival + (len(r.turn.prompt) - r.cached_tokens) * PREFILL_S_PER_TOKEN)

    while left:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            turn = payload
            r = SimRequest(f"c{turn.conversation}t{turn.turn}", turn, block_hashes(turn.prompt, args.block_size, root),
                           now)
            t0 = time.perf_counter()
            r.instance = registry.route(r.rid, 0, now, MODEL, r.hashes)
            route_s.append(time.perf_counter() - t0)
            by_id[r.rid] = r
            inst = fleet[r.instance]
            inst.queue.append(r)
            try_start(inst, now)
        elif kind == "finish":
            r = payload
            inst = fleet[r.instance]
            if r.rid not in inst.running:
                continue  # it migrated; its end event at the destination counts
            hits += r.cached_tokens
            prompt_tokens += len(r.turn.prompt)
            inst.finish(r, block_hashes(r.turn.prompt + r.turn.output, args.block_size, root, r.hashes))
            registry.finish(r.rid, RequestStatus.FINISHED, now)
            left -= 1
            if r.turn.turn == 0:  # the user reads the answer, then asks the second question
                heapq.heappush(events, (now + rng.uniform(1.0, 5.0), next(tick), "arrive", second[r.turn.conversation]))
            try_start(inst, now)
        elif kind == "poll":
            for i, inst in fleet.items():
                registry.update(i, inst.stats(), True, None, now)
                registry.prefix.apply(i, inst.events())
            registry.prefix.expire(now)
            heapq.heappush(events, (now + args.poll_s, next(tick), "poll", None))
        elif kind == "drain":
            for i in rng.sample(sorted(fleet), int(args.drain * len(fleet))):
                registry.set_draining(i)
                draining.add(i)
        elif kind == "plan":
            loads = [replace(inst.load(), draining=i in draining, accepting=i not in draining)
                     for i, inst in fleet.items()]
            t0 = time.perf_counter()
            moves = planner.plan(loads)
            plan_s.append(time.perf_counter() - t0)
            for m in moves:  # carried out at once: the simulation measures planning, not copying
                src, dst, r = fleet[m.source], fleet[m.destination], by_id[m.request_id]
                if r.rid in src.running:  # it keeps its end time (a live migration's downtime is milliseconds)
                    dst.running[r.rid] = src.running.pop(r.rid)
                elif r in src.queue:
                    src.queue.remove(r)
                    dst.queue.append(r)
                else:
                    continue
                r.instance = m.destination
                registry.rehome(r.rid, m.destination)
                moved += 1
                try_start(dst, now)
                try_start(src, now)
            heapq.heappush(events, (now + args.plan_s, next(tick), "plan", None))
    return {
        "policy": policy, "requests": 2 * len(trace), "rate_conversations_per_s": round(rate, 1),
        "route_ms_p50": round(1e3 * _pct(route_s, 0.5), 4), "route_ms_p99": round(1e3 * _pct(route_s, 0.99), 4),
        "plan_ms_p50": round(1e3 * _pct(plan_s, 0.5), 3), "plan_ms_p99": round(1e3 * _pct(plan_s, 0.99), 3),
        "planning_rounds": len(plan_s), "migrations": moved, "hit_rate": round(hits / max(prompt_tokens, 1), 4),
        "ttft_s_p50": round(_pct(ttft, 0.5), 4), "ttft_s_p99": round(_pct(ttft, 0.99), 4),
        "decisions": dict(registry.decisions), "index_entries": len(registry.prefix),
        "index_mb": round(_index_bytes(registry.prefix, args.index_max_entries) / 2**20, 2),
    }


def _index_bytes(index: PrefixIndex, max_entries: int) -> int:
    """Memory of an index holding what `index` holds (rebuilt under tracemalloc: tracing the run would slow it)."""
    held = index.snapshot_of()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    copy = PrefixIndex(max_entries=max_entries)
    for i, hashes in held.items():
        copy.apply(i, CacheEvents(1, tuple(hashes), snapshot=True))
    size = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del copy
    return size


def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    trace = conversations(args.questions, args.conversations, args.system_prompt_tokens, rng)
    rows = []
    for policy in args.policies:
        t0 = time.perf_counter()
        rows.append(simulate(args, policy, trace, args.seed))
        print(f"{policy}: simulated in {time.perf_counter() - t0:.1f}s", flush=True)
    _print(args, rows)
    save({"command": "specfleet bench router-sim", "instances": args.instances, "conversations": args.conversations,
          "system_prompt_tokens": args.system_prompt_tokens, "rows": rows}, args.json, None, lambda *_: None)
    return 0


def _print(args: argparse.Namespace, rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"router at {args.instances} instances, {2 * args.conversations} requests "
                    f"(system prompt {args.system_prompt_tokens} tokens)")
    for col in ("policy", "route p50 ms", "route p99 ms", "plan p50 ms", "plan p99 ms", "moves", "hit rate",
                "TTFT p50 s", "TTFT p99 s", "index entries", "index MB"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for r in rows:
        t.add_row(r["policy"], f"{r['route_ms_p50']:.3f}", f"{r['route_ms_p99']:.3f}", f"{r['plan_ms_p50']:.1f}",
                  f"{r['plan_ms_p99']:.1f}", str(r["migrations"]), f"{r['hit_rate']:.3f}", f"{r['ttft_s_p50']:.3f}", f"{r['ttft_s_p99']:.3f}",
                  str(r["index_entries"]), f"{r['index_mb']:.1f}")
    console = Console(width=max(Console().width, 150))
    console.print(t)
    for r in rows:
        console.print(f"{r['policy']}: decisions {r['decisions']}")

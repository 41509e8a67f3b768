"""`specfleet bench autoscale-sim`: the SLO autoscaling policy driving a simulated fleet of up to 1,000 instances.

The policy (cluster/autoscale.py), the signal reader, the registry's dispatch and the migration planner's `drain`
policy are pure code, so this runs the real ones on plain data, as `bench router-sim` does for dispatch: a fleet of
simulated instances (each runs `slots` requests at once for their duration, the rest queue first come first
served), a Poisson load whose rate steps up then down, stats reaching the router every `poll_s`, and the autoscaler
deciding every `interval_s` from the router's rows. Scaling out adds an instance after `start_s`; scaling in drains
one: the drain policy moves its running and queued requests to the others (a live migration's downtime is
milliseconds, so each keeps its end time), and it leaves once empty. Time is simulated; what is measured: the fleet's
size over time, every step with its reason, how long the fleet took from its first step up to its largest size, the
wall time of each decision at the fleet's size, requests lost (0:
each arrival ends, none restarted), time to first token (queue wait) against the target, instance-seconds.
"""

from __future__ import annotations

import argparse
import heapq
import random
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from cluster.autoscale import (AUTOSCALED_PREFIX, AutoscalePolicy, AutoscaleTarget, AutoscalingConfig, SignalReader,
                               percentile)
from cluster.dispatch import make_dispatch
from cluster.migration_policy import InstanceLoad, RequestLoad, make_planner
from cluster.registry import Registry
from cluster.request import RequestStatus
from cluster.stats import EngineStats, LoadStats, StepStats
from deploy.bench.output import save

MODEL = "sim-model"
STEP_S = 0.02  # a decode step: the inter-token latency of a running request


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--min-instances", type=int, default=980)
    p.add_argument("--max-instances", type=int, default=1000)
    p.add_argument("--slots", type=int, default=4, help="requests one instance runs at once")
    p.add_argument("--duration-s", type=float, default=10.0, help="a request's mean run time")
    p.add_argument("--rates", type=float, nargs="+", default=[0.95, 1.04, 0.9],
                   help="load steps, as a share of the max fleet's capacity, each held --phase-s")
    p.add_argument("--phase-s", type=float, default=60.0)
    p.add_argument("--ttft-target-s", type=float, default=1.0)
    p.add_argument("--queue-target", type=float, default=0.5)
    p.add_argument("--up-after-s", type=float, default=1.0)
    p.add_argument("--down-after-s", type=float, default=5.0)
    p.add_argument("--cooldown-s", type=float, default=0.5)
    p.add_argument("--start-s", type=float, default=2.0, help="a new instance's start")
    p.add_argument("--poll-s", type=float, default=0.5)
    p.add_argument("--max-step", type=int, default=None,
                   help="instances one step adds or removes at most (default: proportional, within the bounds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)


@dataclass
class SimInstance:
    """Runs at most `slots` requests (request id -> end time), queues the rest first come first served."""

    instance_id: str
    slots: int
    running: dict[str, float] = field(default_factory=dict)
    queue: deque = field(default_factory=deque)  # (request id, run time)

    def stats(self) -> EngineStats:
        n = len(self.running)
        return EngineStats(LoadStats(running=n, waiting=len(self.queue), kv_blocks_used=n, kv_blocks_free=self.slots - n),
                           StepStats(step_time_s=STEP_S, step_time_ema_s=STEP_S, batch_size=n, batch_tokens=n))

    def load(self, draining: bool) -> InstanceLoad:
        return InstanceLoad(self.instance_id, self.slots, tuple(RequestLoad(r, 1) for r in self.running),
                            tuple(RequestLoad(r, 1) for r, _ in self.queue), draining=draining,
                            accepting=not draining, max_running=self.slots)


def simulate(args: argparse.Namespace) -> dict:
    """Run the stepped load through the autoscaled fleet; the measured figures."""
    rng = random.Random(args.seed)
    cfg = AutoscalingConfig(min_instances=args.min_instances, max_instances=args.max_instances,
                            target=AutoscaleTarget(ttft_p99_s=args.ttft_target_s, queue_per_instance=args.queue_target),
                            up_after_s=args.up_after_s, down_after_s=args.down_after_s, cooldown_s=args.cooldown_s,
                            interval_s=args.poll_s, window_s=10 * args.poll_s, max_step=args.max_step)
    policy, reader = AutoscalePolicy(cfg, args.slots), SignalReader(cfg.window_s, args.slots)
    registry = Registry(make_dispatch("least_load"), keep_finished=0)
    drain = make_planner(["drain"])
    fleet: dict[str, SimInstance] = {}
    events: list[tuple[float, int, str, object]] = []  # (time, tiebreak, kind, payload)
    tick = iter(range(10**12))

    def add(instance_id: str, now: float) -> None:
        fleet[instance_id] = SimInstance(instance_id, args.slots)
        registry.register(instance_id, MODEL, "node", now)
        registry.update(instance_id, fleet[instance_id].stats(), True, None, now)

    for n in range(cfg.min_instances):
        add(f"inst-{n}", 0.0)
    capacity = cfg.max_instances * args.slots / args.duration_s  # requests/s the max fleet serves
    t = 0.0
    for phase, share in enumerate(args.rates):
        end = (phase + 1) * args.phase_s
        while True:
            t += rng.expovariate(share * capacity)
            if t >= end:
                t = end
                break
            heapq.heappush(events, (t, next(tick), "arrive", rng.uniform(0.5, 1.5) * args.duration_s))
    heapq.heappush(events, (args.poll_s, next(tick), "decide", None))
    arrived = finished = moved = 0
    arrival: dict[str, float] = {}
    where: dict[str, str] = {}  # request id -> the instance it is on
    ttft: list[float] = []
    decide_s: list[float] = []
    sizes: list[tuple[float, int]] = []
    steps: list[dict] = []
    starting: set[str] = set()
    draining: set[str] = set()
    instance_s, last_t, next_id = 0.0, 0.0, 0

    def start_queued(inst: SimInstance, now: float) -> None:
        while inst.queue and len(inst.running) < inst.slots:
            rid, run_s = inst.queue.popleft()
            inst.running[rid] = now + run_s
            ttft.append(now - arrival[rid] + STEP_S)
            heapq.heappush(events, (now + run_s, next(tick), "finish", rid))

    while events:
        now, _, kind, payload = heapq.heappop(events)
        instance_s += (len(fleet) + len(starting)) * (now - last_t)  # a starting instance holds its devices too
        last_t = now
        if kind == "arrive":
            rid = f"r{arrived}"
            arrived += 1
            arrival[rid] = now
            where[rid] = registry.route(rid, 0, now, MODEL)
            inst = fleet[where[rid]]
            inst.queue.append((rid, payload))
            start_queued(inst, now)
        elif kind == "finish":
            rid = payload
            inst = fleet[where.pop(rid)]
            del inst.running[rid]
            registry.finish(rid, RequestStatus.FINISHED, now)
            finished += 1
            start_queued(inst, now)
        elif kind == "started":
            starting.discard(payload)
            add(payload, now)
        elif kind == "decide":
            for i, inst in fleet.items():  # the router's poll
                registry.update(i, inst.stats(), True, None, now)
            if draining:  # the drain policy moves what the draining instances hold, as the router's planner does
                for m in drain.plan([inst.load(i in draining) for i, inst in fleet.items()]):
                    src, dst = fleet[m.source], fleet[m.destination]
                    if m.request_id in src.running:
                        dst.running[m.request_id] = src.running.pop(m.request_id)  # keeps its end time
                    else:
                        entry = next(q for q in src.queue if q[0] == m.request_id)
                        src.queue.remove(entry)
                        dst.queue.append(entry)
                        start_queued(dst, now)
                    registry.rehome(m.request_id, m.destination)
                    where[m.request_id] = m.destination
                    moved += 1
                for i in draining:  # a slot a moved request freed runs the next queued one, as an engine would
                    start_queued(fleet[i], now)
                for i in [i for i in draining if not fleet[i].running and not fleet[i].queue]:
                    registry.remove(i, now)
                    del fleet[i]
                    draining.discard(i)
            rows = [e.row() for e in registry.instances.values()]
            t0 = time.thread_time()  # the decision's CPU time: what it costs the router, whatever else runs
            signal = reader.read(rows, now, starting=len(starting), start_s=args.start_s)  # the start it takes
            d = policy.decide(signal, now)
            decide_s.append(time.thread_time() - t0)
            if d.action == "up":
                for _ in range(d.count):
                    new = f"{AUTOSCALED_PREFIX}{next_id}"
                    next_id += 1
                    starting.add(new)
                    heapq.heappush(events, (now + args.start_s, next(tick), "started", new))
            for leaving in d.remove if d.action == "down" else ():
                registry.set_draining(leaving)
                draining.add(leaving)
            if d.action != "hold":
                steps.append({"t": round(now, 2), "action": d.action, "size": d.instances, "count": d.count,
                              "reason": d.reason})
            sizes.append((now, signal.size))
            if arrived < 1 or finished < arrived or now < len(args.rates) * args.phase_s:
                heapq.heappush(events, (now + args.poll_s, next(tick), "decide", None))
    flips = sum(a["action"] != b["action"] for a, b in zip(steps, steps[1:]))
    top = max(n for _, n in sizes)
    first_up = next((s["t"] for s in steps if s["action"] == "up"), None)
    # from the first step up until the fleet (starting instances counted) first reached its largest size
    grow_s = None if first_up is None else next(t for t, n in sizes if n == top) - first_up
    return {
        "min_instances": cfg.min_instances, "max_instances": cfg.max_instances, "max_step": cfg.max_step,
        "rates": list(args.rates),
        "requests": arrived, "finished": finished, "lost": arrived - finished, "migrated": moved,
        "steps_up": sum(s["action"] == "up" for s in steps), "steps_down": sum(s["action"] == "down" for s in steps),
        "direction_changes": flips, "size_min": min(n for _, n in sizes), "size_max": max(n for _, n in sizes),
        "size_end": sizes[-1][1], "grow_s": None if grow_s is None else round(grow_s, 1), "decide_ms_p50": round(1e3 * percentile(decide_s, 0.5), 3),
        "decide_ms_p99": round(1e3 * percentile(decide_s, 0.99), 3),
        "ttft_s_p99": round(percentile(ttft, 0.99) or 0.0, 3),
        "instance_s": round(instance_s), "max_fleet_instance_s": round(cfg.max_instances * last_t),
        "steps": steps,
    }


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    row = simulate(args)
    steps = row.pop("steps")
    print(f"simulated in {time.perf_counter() - t0:.1f} s")
    for key, value in row.items():
        print(f"{key}: {value}")
    for s in steps[:3] + steps[-3:]:
        print(f"  t={s['t']:.1f} s {s['action']} at {s['size']}: {s['reason']}")
    save({"command": "specfleet bench autoscale-sim", **row, "steps": steps}, args.json, None, lambda *_: None)
    return 0

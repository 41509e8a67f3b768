"""`bench serve --throughput N`: output tokens/s of N streams at once through Serve HTTP next to the engine at batch N.

Side by side in one run, on the same prompts (token ids), greedy, `ignore_eos`, `--max-tokens` each, in alternating
rounds (HTTP first, then in process, then llama-server if asked, `--throughput-rounds` times):

- served: N streaming /v1/completions at once over HTTP (the bench's own client, in this process);
- in process: the served config's instance built in this process, the same N requests submitted at once to the same
  ServingLoop (actors/serving/loop.py) the instance actor runs, no Ray, no HTTP;
- with `--llama-server`, llama.cpp's own server (`llama-server -np N`, deploy/bench/llama_server.py) on the served
  config's GGUF file: the same N requests at once to its streaming /completion, by the same client.

Each round reports tokens/s (all tokens over the span from the first send to the last token), the chunks (SSE events
with text, or the loop's deltas) per request, and CPU seconds: this process's own (the client: its HTTP parsing runs on
the same cores as the app) and, for a local cluster, each of the cluster's processes grouped by role (the instance
actor, the API replica, Serve's proxy, the rest) and llama-server's process, so the served path's cost can be
apportioned.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

import psutil

from deploy.bench.output import pct
from deploy.cli.flags import UsageError


def cluster_processes(pids: list[int]) -> list[psutil.Process]:
    """The local cluster's processes: each node's `ray start --block` process and everything under it."""
    out = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            out += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    return out


def role(name: str) -> str:
    """A Ray process's role in the served path, from its title (`ray::InstanceServer`, `ray::ServeReplica:...`)."""
    if "InstanceServer" in name or "SpecfleetInstance" in name:
        return "instance"
    if "SpecfleetAPI" in name:
        return "api_replica"
    if "ProxyActor" in name:
        return "serve_proxy"
    if "llama-server" in name:
        return "llama_server"
    return "other"


class CpuMeter:
    """CPU seconds (user + system) of this process and of the cluster's processes by role, between start and stop."""

    def __init__(self, pids: list[int]) -> None:
        self.procs = cluster_processes(pids)
        self._t0: dict[int, float] = {}
        self._self0 = 0.0

    def _times(self) -> dict[int, tuple[str, float]]:
        out = {}
        for p in self.procs:
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    out[p.pid] = (role(p.name()), t.user + t.system)
            except psutil.NoSuchProcess:
                continue
        return out

    def start(self) -> None:
        self._self0 = time.process_time()
        self._t0 = {pid: s for pid, (_, s) in self._times().items()}

    def stop(self) -> dict[str, float]:
        client = time.process_time() - self._self0
        by_role: Counter = Counter()
        for pid, (r, s) in self._times().items():
            by_role[r] += s - self._t0.get(pid, s)
        return {"client": round(client, 2), **{r: round(s, 2) for r, s in sorted(by_role.items())}}


def served_round(traces, who: str = "served") -> dict:
    """Tokens/s of one round of HTTP streams started at once (deploy/bench/serve.py Trace)."""
    bad = [t for t in traces if not t.ok]
    if bad:
        raise UsageError(f"{len(bad)} of {len(traces)} {who} throughput streams failed: "
                         f"{sorted({t.error or str(t.finish_reason) for t in bad})[:3]}")
    tokens = sum(t.tokens for t in traces)
    span = max(t.last for t in traces) - min(t.sent for t in traces)
    return {"tokens": tokens, "wall_s": round(span, 3), "tok_s": round(tokens / span, 2),
            "chunks_per_request": round(sum(len(t.chunk_times) for t in traces) / len(traces), 1),
            "ttft_p50_ms": round(pct([t.first - t.sent for t in traces], 50) * 1e3, 1)}


class LocalEngine:
    """The served config's instance in this process behind the same ServingLoop as the instance actor."""

    def __init__(self, config: Path) -> None:
        from actors.serving.build import local_instance
        from actors.serving.loop import ServingLoop
        from cluster.config import load_config
        from deploy.serve.fleet import resolved

        self.instance = local_instance(resolved(load_config(config).engine))  # what a one-stage instance actor builds
        self.loop = ServingLoop(self.instance, name="bench-throughput")
        self.rounds = 0

    def batch(self, prompts: list[list[int]], max_tokens: int, timeout_s: float) -> dict:
        """The requests submitted at once; tokens/s over the span from the first submission to the last delta."""
        from cluster.request import Request, SamplingParams, StreamItem

        lock = threading.Lock()
        left = len(prompts)
        done = threading.Event()
        tokens, chunks, first, errors = [0], [0], {}, []

        def sink_for(i: int):
            def sink(item: StreamItem) -> None:
                nonlocal left
                now = time.perf_counter()
                with lock:
                    tokens[0] += len(item.delta.token_ids)
                    if item.delta.text:
                        chunks[0] += 1
                        first.setdefault(i, now)
                    if item.delta.finished:
                        if item.delta.error:
                            errors.append(item.delta.error)
                        left -= 1
                        if left == 0:
                            done.set()
            return sink

        self.rounds += 1
        sent = time.perf_counter()
        futures = [self.loop.submit(Request(f"bench-tput-{self.rounds}-{i}", tuple(ids),
                                            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                                            0, time.time()), sink_for(i))
                   for i, ids in enumerate(prompts)]
        for f in futures:
            f.result(timeout_s)
        if not done.wait(timeout_s):
            raise UsageError(f"the in-process batch did not finish in {timeout_s} s")
        if errors:
            raise UsageError(f"{len(errors)} in-process requests failed: {errors[:3]}")
        span = time.perf_counter() - sent
        return {"tokens": tokens[0], "wall_s": round(span, 3), "tok_s": round(tokens[0] / span, 2),
                "chunks_per_request": round(chunks[0] / len(prompts), 1),
                "ttft_p50_ms": round(pct([t - sent for t in first.values()], 50) * 1e3, 1)}

    def close(self) -> None:
        self.loop.close()
        self.instance.shutdown()


Stream = Callable[[list[int], int], Awaitable]  # (prompt ids, max tokens) -> deploy/bench/serve.py Trace


@dataclass(frozen=True)
class Other:
    """Another server driven by the same client, as a third side of each round: its streams and its process."""

    stream: Stream
    pid: int


async def throughput(stream: Stream, config: Path, prompts: list[list[int]], n: int, max_tokens: int, rounds: int,
                     pids: list[int], timeout_s: float, llama: Other | None = None) -> dict:
    """`rounds` alternating rounds of N HTTP streams at once (`stream(ids, max_tokens)` -> Trace), the in-process
    batch of the same N requests and, with `llama`, the same N streams to llama-server; tokens/s, chunks and CPU
    seconds of each, and the ratios of the pooled tokens/s."""
    batch = [prompts[i % len(prompts)] for i in range(n)]
    await asyncio.gather(*(stream(ids, 4) for ids in batch))  # warm-up: every stream's path is open
    if llama:
        served_round(await asyncio.gather(*(llama.stream(ids, 4) for ids in batch)), "llama-server")  # warm-up
    local = await asyncio.to_thread(LocalEngine, config)
    served_runs, local_runs, llama_runs = [], [], []
    try:
        await asyncio.to_thread(local.batch, batch, 4, timeout_s)  # warm-up
        for _ in range(rounds):
            meter = CpuMeter(pids)
            meter.start()
            traces = await asyncio.gather(*(stream(ids, max_tokens) for ids in batch))
            served_runs.append({**served_round(traces), "cpu_s": meter.stop()})
            print(f"throughput, served: {served_runs[-1]}", flush=True)
            meter = CpuMeter(pids)
            meter.start()
            run = await asyncio.to_thread(local.batch, batch, max_tokens, timeout_s)
            local_runs.append({**run, "cpu_s": meter.stop()})
            print(f"throughput, in process: {local_runs[-1]}", flush=True)
            if llama:
                meter = CpuMeter([llama.pid])
                meter.start()
                traces = await asyncio.gather(*(llama.stream(ids, max_tokens) for ids in batch))
                llama_runs.append({**served_round(traces, "llama-server"), "cpu_s": meter.stop()})
                print(f"throughput, llama-server: {llama_runs[-1]}", flush=True)
    finally:
        await asyncio.to_thread(local.close)
    served, engine = pooled(served_runs), pooled(local_runs)
    out = {"concurrency": n, "max_tokens": max_tokens, "rounds": rounds, "served": served_runs,
           "in_process": local_runs, "served_tok_s": served, "in_process_tok_s": engine,
           "served_over_in_process": round(served / engine, 3),
           "round_ratios": [round(s["tok_s"] / e["tok_s"], 3) for s, e in zip(served_runs, local_runs)]}
    if llama:
        other = pooled(llama_runs)
        out |= {"llama_server": llama_runs, "llama_server_tok_s": other,
                "served_over_llama_server": round(served / other, 3),
                "in_process_over_llama_server": round(engine / other, 3),
                "llama_round_ratios": [round(s["tok_s"] / o["tok_s"], 3) for s, o in zip(served_runs, llama_runs)]}
    return out


def pooled(runs: list[dict]) -> float:
    """Tokens/s over all rounds together (every token over every round's span): a slow round weighs its time."""
    return round(sum(r["tokens"] for r in runs) / sum(r["wall_s"] for r in runs), 2)


def summary(t: dict) -> str:
    text = (f"throughput at {t['concurrency']} streams x {t['max_tokens']} tokens ({t['rounds']} rounds): "
            f"served {t['served_tok_s']} tok/s, in process {t['in_process_tok_s']} tok/s, served / in process = "
            f"{t['served_over_in_process']:.2f}x (rounds: {t['round_ratios']}); CPU s per served round: "
            f"{_cpu_per_round(t['served'])}")
    if "llama_server" in t:
        text += (f"\nllama-server at {t['concurrency']} slots: {t['llama_server_tok_s']} tok/s, served / llama-server"
                 f" = {t['served_over_llama_server']:.2f}x (rounds: {t['llama_round_ratios']}), in process / llama-server"
                 f" = {t['in_process_over_llama_server']:.2f}x; CPU s per llama-server round: "
                 f"{_cpu_per_round(t['llama_server'])}")
    return text


def _cpu_per_round(runs: list[dict]) -> str:
    cpu: Counter = Counter()
    for r in runs:
        cpu.update(r["cpu_s"])
    return ", ".join(f"{k} {v / len(runs):.1f}" for k, v in sorted(cpu.items()))

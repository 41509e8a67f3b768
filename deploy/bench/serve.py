"""`specfleet bench serve`: load through the app's HTTP endpoint, the Serve path's overhead, a concurrency check.

Phases against a running app (`specfleet serve`), all with greedy, ignore_eos streaming completions of
real prompts (MT-Bench or HumanEval) sent as token ids, so every path gets identical inputs:

1. overhead: the same requests one at a time, (a) straight to an engine instance over Ray (the router's
   `route` gives the instance's handle; its `generate` stream is consumed here) and (b) through Serve HTTP,
   alternating which goes first; the per-request difference of end-to-end time and of TTFT, p50 in ms.
2. concurrency: N streams at once over HTTP; each must end with a finish_reason and `data: [DONE]`.
3. Poisson arrivals at each rate for `--duration` s: TTFT, inter-chunk latency, TPOT, end-to-end p50/p99,
   throughput and errors.

After the overhead phase, the same requests go to the same engine config built in the bench's own process
behind the same serving loop (no Ray), so the served TTFT and the engine's own are printed side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

from deploy.infra import local_cluster, ray_node
from deploy.cli.admin_cmd import add_endpoint_flags, endpoint
from deploy.bench import llama_server, serve_throughput
from deploy.bench.prompts import DATASETS, load_prompts
from deploy.bench.output import pct, save
from deploy.cli.flags import UsageError, parse_numbers

DATASET_FILES = {"mtbench": DATASETS / "mt_bench_questions.jsonl", "humaneval": DATASETS / "HumanEval.jsonl.gz"}
ENDED = ("stop", "length")  # finish reasons of a request served to its end


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_endpoint_flags(p)  # --config (tokenizer, default port and keys), --url, --api-key, --admin-key, --timeout
    p.add_argument("--model", help="served model name (default: the app's only model)")
    p.add_argument("--rates", default="0.5,1,2", help="request rates (requests/s), comma-separated ('': skip)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="prompts are cut to their first N tokens")
    p.add_argument("--dataset", choices=sorted(DATASET_FILES), default="mtbench")
    p.add_argument("--overhead-requests", type=int, default=20, help="request pairs of the overhead phase (0: skip)")
    p.add_argument("--throughput", type=int, default=0, metavar="N",
                   help="output tok/s of N HTTP streams at once next to the engine at batch N in this process, "
                        "with CPU seconds by process (0: skip; deploy/bench/serve_throughput.py)")
    p.add_argument("--throughput-rounds", type=int, default=2, help="alternating rounds of the throughput phase")
    p.add_argument("--llama-server", metavar="PATH",
                   help="with --throughput N: llama.cpp's llama-server binary, started with N slots on the served "
                        f"config's GGUF file as a third side of each round (default ${llama_server.ENV}; "
                        "deploy/bench/llama_server.py)")
    p.add_argument("--concurrency", type=int, default=50, help="streams at once in the concurrency check (0: skip)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--state", type=Path, default=local_cluster.DEFAULT_STATE,
                       help="the local cluster's state file, to reach the engines directly (overhead phase)")
    where.add_argument("--address", help="a Ray cluster's GCS address instead of --state")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--plot", type=Path, help="write a PNG of latency and throughput against rate here")
    p.set_defaults(run=run)


@dataclass
class Trace:
    """One request's timestamps (seconds on the run's clock) and outcome."""

    sent: float
    first: float | None = None  # first chunk with text
    last: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    tokens: int = 0
    finish_reason: str | None = None
    done: bool = False  # saw `data: [DONE]` (HTTP) or the final item (direct)
    status: int | None = None  # HTTP status
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.finish_reason in ENDED and self.done and self.error is None


# ---- the two paths --------------------------------------------------------------------------------------
Event = Callable[[Trace, dict, float], None]  # one SSE event's JSON into a Trace, at a time


async def http_stream(c: httpx.AsyncClient, model: str, ids: list[int], max_tokens: int) -> Trace:
    """One streaming /v1/completions request with a token-id prompt, its SSE parsed as it arrives."""
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    return await sse_stream(c, "/v1/completions", body, _chunk)


async def sse_stream(c: httpx.AsyncClient, path: str, body: dict, on_event: Event) -> Trace:
    """One streaming POST, each `data:` line given to `on_event` as it arrives (the same client for the app and for
    llama-server, deploy/bench/llama_server.py)."""
    t = Trace(time.perf_counter())
    try:
        async with c.stream("POST", path, json=body) as r:
            t.status = r.status_code
            if r.status_code != 200:
                t.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return t
            async for line in r.aiter_lines():
                sse_line(t, line, on_event, time.perf_counter())
    except httpx.HTTPError as e:
        t.error = f"{type(e).__name__}: {e}"
    return t


def sse_line(t: Trace, line: str, on_event: Event, now: float) -> None:
    """One line of an SSE body: `data: [DONE]` ends the stream, another `data:` line is an event, the rest (blank
    separators, comments) is skipped."""
    if not line.startswith("data: "):
        return
    data = line[len("data: "):]
    if data == "[DONE]":
        t.done = True
    else:
        on_event(t, json.loads(data), now)


def _chunk(t: Trace, obj: dict, now: float) -> None:
    if "error" in obj:
        t.error = obj["error"].get("message", "error")
    if obj.get("usage"):
        t.tokens = obj["usage"]["completion_tokens"]
    for ch in obj.get("choices", []):
        if ch.get("text"):
            t.first = t.first or now
            t.last = now
            t.chunk_times.append(now)
        if ch.get("finish_reason"):
            t.finish_reason = ch["finish_reason"]
            t.last = now


class Direct:
    """Straight to an engine instance: the router routes, the bench consumes the instance's stream over Ray."""

    def __init__(self, address: str, env: dict[str, str], model: str) -> None:
        import ray

        from cluster.router import NAMESPACE, ROUTER_NAME

        os.environ.pop("RAY_ADDRESS", None)
        ray_node.connect(address, env, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
        self.router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
        self.model = model
        self.route_s: list[float] = []

    async def stream(self, ids: list[int], max_tokens: int) -> Trace:
        from cluster.request import Request, RequestStatus, SamplingParams

        rid = f"bench-direct-{uuid.uuid4().hex}"
        t = Trace(time.perf_counter())
        _, handle = await self.router.route.remote(rid, 0, self.model, None)
        self.route_s.append(time.perf_counter() - t.sent)
        status = RequestStatus.ABORTED
        try:
            request = Request(rid, tuple(ids), SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                              0, time.time())
            async for ref in handle.generate.options(num_returns="streaming").remote(request):
                item = await ref
                now = time.perf_counter()
                d = item.delta
                t.tokens += len(d.token_ids)
                if d.text:
                    t.first = t.first or now
                    t.last = now
                    t.chunk_times.append(now)
                if d.finished:
                    t.finish_reason, t.error, t.done, t.last = d.finish_reason.value, d.error, True, now
                    status = RequestStatus.of(d.finish_reason)
                    break
        finally:
            await self.router.finish.remote(rid, status)
        return t

    def close(self) -> None:
        import ray

        ray.shutdown()


# ---- phases ---------------------------------------------------------------------------------------------
async def overhead(c: httpx.AsyncClient, direct: Direct, model: str, prompts: list[list[int]], n: int,
                   max_tokens: int) -> dict:
    """n request pairs, one at a time, alternating which path goes first: Serve HTTP minus direct, per request."""
    pairs = []
    for i in range(n):
        ids = prompts[i % len(prompts)]
        if i % 2 == 0:
            d = await direct.stream(ids, max_tokens)
            h = await http_stream(c, model, ids, max_tokens)
        else:
            h = await http_stream(c, model, ids, max_tokens)
            d = await direct.stream(ids, max_tokens)
        if not (d.ok and h.ok):
            raise UsageError(f"overhead pair {i} failed: direct {d.error or d.finish_reason}, "
                             f"HTTP {h.error or h.finish_reason}")
        pairs.append((d, h))
    e2e = [(h.last - h.sent) - (d.last - d.sent) for d, h in pairs]
    ttft = [(h.first - h.sent) - (d.first - d.sent) for d, h in pairs if d.first and h.first]
    return {"requests": n, "max_tokens": max_tokens,
            "overhead_e2e_p50_ms": _ms(pct(e2e, 50)), "overhead_ttft_p50_ms": _ms(pct(ttft, 50)),
            "overhead_e2e_p90_ms": _ms(pct(e2e, 90)),
            "direct_e2e_p50_ms": _ms(pct([d.last - d.sent for d, _ in pairs], 50)),
            "http_e2e_p50_ms": _ms(pct([h.last - h.sent for _, h in pairs], 50)),
            "direct_ttft_p50_ms": _ms(pct([d.first - d.sent for d, _ in pairs if d.first], 50)),
            "http_ttft_p50_ms": _ms(pct([h.first - h.sent for _, h in pairs if h.first], 50)),
            "route_call_p50_ms": _ms(pct(direct.route_s, 50))}


def in_process(config: Path, prompts: list[list[int]], n: int, max_tokens: int, timeout_s: float) -> dict:
    """The served config's instance built in this process and driven by the same ServingLoop as the instance
    actor (actors/serving/loop.py), without Ray: TTFT and end-to-end p50 of the overhead phase's requests."""
    import threading

    from actors.serving.build import local_instance
    from actors.serving.loop import ServingLoop
    from cluster.config import load_config
    from cluster.request import Request, SamplingParams, StreamItem
    from deploy.serve.fleet import resolved

    instance = local_instance(resolved(load_config(config).engine))  # what a one-stage instance actor builds
    loop = ServingLoop(instance, name="bench-in-process")
    ttft, e2e = [], []
    try:
        for i in range(n + 1):  # the first is a warm-up
            first: list[float] = []
            done = threading.Event()

            def sink(item: StreamItem) -> None:
                if item.delta.text and not first:
                    first.append(time.perf_counter())
                if item.delta.finished:
                    done.set()

            sent = time.perf_counter()
            request = Request(f"bench-local-{i}", tuple(prompts[i % len(prompts)]),
                              SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), 0, time.time())
            loop.submit(request, sink).result(timeout_s)
            if not done.wait(timeout_s) or not first:
                raise UsageError(f"in-process request {i} did not finish in {timeout_s} s")
            if i:
                ttft.append(first[0] - sent)
                e2e.append(time.perf_counter() - sent)
    finally:
        loop.close()
        instance.shutdown()
    return {"requests": n, "ttft_p50_ms": _ms(pct(ttft, 50)), "e2e_p50_ms": _ms(pct(e2e, 50))}


async def concurrency(c: httpx.AsyncClient, model: str, prompts: list[list[int]], n: int, max_tokens: int) -> dict:
    """n streams started at once; each must end with a finish_reason and [DONE]."""
    traces = await asyncio.gather(*(http_stream(c, model, prompts[i % len(prompts)], max_tokens) for i in range(n)))
    rejected = [t for t in traces if t.status not in (None, 200)]
    completed = [t for t in traces if t.ok]
    return {"streams": n, "completed": len(completed), "rejected": len(rejected),
            "lost": n - len(completed) - len(rejected),
            "errors": sorted({t.error for t in traces if t.error})[:5],
            "wall_s": round(max((t.last or t.sent) for t in traces) - min(t.sent for t in traces), 3)}


async def poisson(c: httpx.AsyncClient, model: str, prompts: list[list[int]], rate: float, duration: float,
                  max_tokens: int, rng: random.Random) -> dict:
    """Arrivals at `rate` for `duration` s (at least one), each a random prompt; waits for every request."""
    arrivals, at = [], 0.0
    while (at := at + rng.expovariate(rate)) <= duration:
        arrivals.append(at)
    arrivals = arrivals or [0.0]
    picks = [prompts[rng.randrange(len(prompts))] for _ in arrivals]
    start = time.perf_counter()

    async def one(at: float, ids: list[int]) -> Trace:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        return await http_stream(c, model, ids, max_tokens)

    traces = await asyncio.gather(*(one(a, p) for a, p in zip(arrivals, picks)))
    return summarize(rate, traces)


def summarize(rate: float, traces: list[Trace]) -> dict:
    ok = [t for t in traces if t.ok]
    e2e = [t.last - t.sent for t in ok]
    ttft = [t.first - t.sent for t in ok if t.first]
    itl = [b - a for t in ok for a, b in zip(t.chunk_times, t.chunk_times[1:])]
    tpot = [(t.last - t.first) / (t.tokens - 1) for t in ok if t.first and t.tokens > 1]
    span = (max(t.last for t in ok) - min(t.sent for t in traces)) if ok else float("nan")
    tokens = sum(t.tokens for t in ok)
    return {"rate": rate, "requests": len(traces), "completed": len(ok), "errors": len(traces) - len(ok),
            "error_samples": sorted({t.error or str(t.finish_reason) for t in traces if not t.ok})[:3],
            "tokens": tokens, "throughput_tok_s": round(tokens / span, 2) if ok else 0.0,
            "throughput_req_s": round(len(ok) / span, 3) if ok else 0.0,
            "ttft_p50_ms": _ms(pct(ttft, 50)), "ttft_p99_ms": _ms(pct(ttft, 99)),
            "itl_p50_ms": _ms(pct(itl, 50)), "itl_p99_ms": _ms(pct(itl, 99)),
            "tpot_mean_ms": _ms(sum(tpot) / len(tpot)) if tpot else None,
            "e2e_p50_ms": _ms(pct(e2e, 50)), "e2e_p99_ms": _ms(pct(e2e, 99))}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 2)


# ---- the command ----------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    rates = parse_numbers(args.rates, "--rates", float, "numbers like 0.5,1,2")
    if any(r <= 0 for r in rates) or args.duration <= 0 or args.max_tokens < 1 or args.max_prompt_tokens < 1:
        raise UsageError("--rates must be > 0, --duration > 0, --max-tokens and --max-prompt-tokens >= 1")
    if args.concurrency < 0 or args.overhead_requests < 0 or args.throughput < 0 or args.throughput_rounds < 1:
        raise UsageError("--concurrency, --overhead-requests and --throughput must be >= 0, --throughput-rounds >= 1")
    if args.plot and not rates:
        raise UsageError("--plot needs at least one rate in --rates")
    if args.llama_server and not args.throughput:
        raise UsageError("--llama-server is a side of the throughput phase: give --throughput N as well")
    exe = args.llama_server or os.environ.get(llama_server.ENV)
    args.llama_exe = llama_server.binary(exe) if exe and args.throughput else None
    report = asyncio.run(_bench(args, rates))
    _print(report)
    save(report, args.json, args.plot, _plot)
    return 0


async def _bench(args: argparse.Namespace, rates: list[float]) -> dict:
    e = endpoint(args)
    headers = {"Authorization": f"Bearer {e.api_key}"} if e.api_key else {}
    limits = httpx.Limits(max_connections=max(100, args.concurrency + 10, args.throughput + 10),
                          max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=e.url, headers=headers, timeout=args.timeout * 10, limits=limits) as c:
        model, context = await _model(c, e.url, args.model)
        prompts = _prompts(args, context)
        warm = await http_stream(c, model, prompts[0], 4)
        if not warm.ok:
            raise UsageError(f"a first request to {e.url} failed: {warm.error or warm.finish_reason}")
        report: dict = {"command": "specfleet bench serve", "url": e.url, "model": model, "dataset": args.dataset,
                        "max_tokens": args.max_tokens, "prompts": len(prompts),
                        "mean_prompt_tokens": round(sum(map(len, prompts)) / len(prompts), 1),
                        "duration_s": args.duration, "cpu_count": os.cpu_count()}
        if args.overhead_requests:
            if args.address:
                address, env = args.address, {}
            else:
                state = local_cluster.read_state(args.state)
                address, env = state.address, local_cluster.client_env(state)
            direct = Direct(address, env, model)
            try:
                await direct.stream(prompts[0], 4)  # warm-up of the direct path
                report["overhead"] = await overhead(c, direct, model, prompts, args.overhead_requests,
                                                    args.max_tokens)
            finally:
                direct.close()
            print(f"overhead: {report['overhead']}", flush=True)
            report["in_process"] = await asyncio.to_thread(in_process, args.config, prompts,
                                                           args.overhead_requests, args.max_tokens, args.timeout * 10)
            print(f"in process: {report['in_process']}", flush=True)
        if args.throughput:
            pids = [] if args.address else [n.pid for n in local_cluster.read_state(args.state).nodes]
            async with contextlib.AsyncExitStack() as stack:
                llama = await _llama_side(stack, args, prompts, limits, report) if args.llama_exe else None
                report["throughput"] = await serve_throughput.throughput(
                    lambda ids, m: http_stream(c, model, ids, m), args.config, prompts, args.throughput,
                    args.max_tokens, args.throughput_rounds, pids, args.timeout * 10, llama)
        if args.concurrency:
            report["concurrency"] = await concurrency(c, model, prompts, args.concurrency, args.max_tokens)
            print(f"concurrency: {report['concurrency']}", flush=True)
        rng = random.Random(args.seed)
        report["runs"] = []
        for rate in rates:
            report["runs"].append(await poisson(c, model, prompts, rate, args.duration, args.max_tokens, rng))
            print(f"rate {rate:g}/s: {report['runs'][-1]}", flush=True)
    return report


async def _llama_side(stack: contextlib.AsyncExitStack, args: argparse.Namespace, prompts: list[list[int]],
                      limits: httpx.Limits, report: dict) -> serve_throughput.Other:
    """llama-server started (and stopped by `stack`) with a slot per stream on the served config's GGUF file, as
    many threads as its instance gets, each slot room for the longest prompt and --max-tokens; the same client."""
    from cluster.config import load_config
    from deploy.model_store import resolve_model

    config = load_config(args.config)
    gguf = Path(await asyncio.to_thread(resolve_model, config.engine.model.target))  # a catalog name: fetched if absent
    if gguf.suffix != ".gguf" or not gguf.is_file():
        raise UsageError(f"--llama-server runs on a GGUF file; {args.config}'s model is {gguf}")
    slot_ctx = max(map(len, prompts)) + args.max_tokens + 16
    server = await stack.enter_async_context(llama_server.LlamaServer(
        args.llama_exe, gguf, args.throughput, slot_ctx, llama_server.threads(config.fleet.instance_num_cpus)))
    report["llama_server"] = server.describe()
    print(f"llama-server: {report['llama_server']}", flush=True)
    c = await stack.enter_async_context(httpx.AsyncClient(base_url=server.url, timeout=args.timeout * 10,
                                                          limits=limits))
    return serve_throughput.Other(
        lambda ids, m: sse_stream(c, "/completion", llama_server.body(ids, m), llama_server.event), server.pid)


async def _model(c: httpx.AsyncClient, url: str, wanted: str | None) -> tuple[str, int]:
    """The served model's name and context length, from /v1/models."""
    try:
        r = await c.get("/v1/models")
    except httpx.ConnectError as e:
        raise UsageError(f"the specfleet app is not reachable at {url} ({e}); "
                         "start it with `specfleet serve`") from None
    if r.status_code == 401:
        raise UsageError("wrong API key: set --api-key or $SPECFLEET_API_KEYS or the config's api_keys_file")
    r.raise_for_status()
    models = {m["id"]: m.get("max_model_len") or 0 for m in r.json()["data"]}
    if not models:
        raise UsageError(f"{url} serves no model yet (no healthy instance)")
    name = wanted or next(iter(models))
    if name not in models:
        raise UsageError(f"--model {name!r}: {url} serves {sorted(models)}")
    return name, models[name]


def _prompts(args: argparse.Namespace, context: int) -> list[list[int]]:
    """The dataset's prompts as token ids (the served model's tokenizer, its chat template if any), cut to fit."""
    from actors.model.loader import load_metadata
    from cluster.config import load_config
    from deploy.serve.fleet import resolved

    m = resolved(load_config(args.config).engine).model
    meta = load_metadata(m.target, m.dtype)
    room = min(args.max_prompt_tokens, context - args.max_tokens - 1) if context else args.max_prompt_tokens
    if room < 1:
        raise UsageError(f"--max-tokens {args.max_tokens} leaves no room for a prompt in a {context}-token context")
    return [meta.encode(text, chat=True)[:room] for text in load_prompts([DATASET_FILES[args.dataset]])]


def _print(report: dict) -> None:
    if o := report.get("overhead"):
        print(f"\nServe HTTP vs direct to the engine, {o['requests']} requests one at a time: overhead p50 "
              f"{o['overhead_e2e_p50_ms']} ms end to end, {o['overhead_ttft_p50_ms']} ms TTFT "
              f"(direct e2e p50 {o['direct_e2e_p50_ms']} ms, HTTP {o['http_e2e_p50_ms']} ms)")
    if (o := report.get("overhead")) and (local := report.get("in_process")):
        print(f"TTFT p50, {o['max_tokens']}-token completions: in one process {local['ttft_p50_ms']} ms, "
              f"straight to the instance actor {o['direct_ttft_p50_ms']} ms, through Serve HTTP "
              f"{o['http_ttft_p50_ms']} ms (actor / in process = "
              f"{o['direct_ttft_p50_ms'] / local['ttft_p50_ms']:.2f}x)")
    if t := report.get("throughput"):
        print(serve_throughput.summary(t))
    if c := report.get("concurrency"):
        print(f"{c['streams']} concurrent streams: {c['completed']} completed with [DONE], {c['rejected']} rejected, "
              f"{c['lost']} lost, in {c['wall_s']} s")
    print(f"\n{'rate':>5}{'req':>5}{'ok':>5}{'err':>4}{'tok/s':>8}{'TTFT p50':>9}{'p99':>8}{'ITL p50':>8}{'p99':>8}"
          f"{'E2E p50':>9}{'p99':>8}   (ms)")
    for r in report["runs"]:
        cells = [r[k] if r[k] is not None else float("nan") for k in
                 ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms", "e2e_p99_ms")]
        print(f"{r['rate']:>5g}{r['requests']:>5}{r['completed']:>5}{r['errors']:>4}{r['throughput_tok_s']:>8.1f}"
              f"{cells[0]:>9.0f}{cells[1]:>8.0f}{cells[2]:>8.0f}{cells[3]:>8.0f}{cells[4]:>9.0f}{cells[5]:>8.0f}")


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    rates = [r["rate"] for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for key, label in (("e2e_p50_ms", "e2e p50"), ("e2e_p99_ms", "e2e p99")):
        axes[0].plot(rates, [r[key] for r in runs], "o-", label=label)
    for key, label in (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"), ("itl_p50_ms", "ITL p50")):
        axes[1].plot(rates, [r[key] for r in runs], "o-", label=label)
    axes[2].plot(rates, [r["throughput_tok_s"] for r in runs], "o-")
    for ax, label in zip(axes, ("latency (ms)", "latency (ms)", "throughput (tokens/s)")):
        ax.set_xlabel("request rate (1/s)")
        ax.set_ylabel(label)
    axes[0].legend()
    axes[1].legend()
    title = f"{report['model']} via Serve HTTP, {report['max_tokens']} tokens per request"
    if o := report.get("overhead"):
        title += f"; Serve overhead p50 {o['overhead_e2e_p50_ms']} ms"
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)

"""`specfleet bench agent`: a multi-turn tool-calling agent loop, speculation off vs n-gram vs suffix, side by side.

The workload is deploy/bench/agent_loop.py's: dataset questions put to an agent with two scripted tools; each turn
the model calls tools (their results go back) or answers. Each mode serves the same model on its own instance of
the local cluster, with the app's default engine config (deploy/configs/default.yaml: bf16, the batch-invariant
deterministic forward, prefix caching) and only the speculation changed:

  off     plain decoding
  ngram   n-gram prompt lookup with the goodput policy (the default's)
  suffix  suffix lookup (SuffixDecoding) with the goodput policy

Turns go through the API's own frontend (deploy/serve/frontend.py: chat template with the tools, the tool grammar,
the model's tool-call parser) to a router actor and the instance, as in `bench prefix`. At each concurrency the
modes run the whole workload one after another (`--repeats` rounds, the order rotating each round); the figures
are generated tokens per second over the run and the time per turn (mean, p50), with the ratios to `off` measured
in the same run. Every turn's tokens must be the same in every mode (the engine is lossless; the deterministic
bf16 forward makes it exact in bf16): the run fails if not. Run `specfleet cluster up` first. Figures:
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

import ray

from actors.model.device import choose_dtype
from actors.model.loader import load_metadata
from cluster.config import RouterConfig, load_config
from cluster.request import FinishReason
from deploy import DEFAULT_CONFIG
from deploy.bench.agent_loop import TOOLS, TurnOut, figures, run as run_workload
from deploy.bench.output import save
from deploy.bench.prefix import Fleet
from deploy.bench.prompts import DATASETS, load_prompts
from deploy.cli.flags import UsageError
from deploy.cli.tables import show, table
from deploy.infra import local_cluster
from deploy.model_store import resolve_model
from deploy.serve.tools import Tool, plan, template_tools

MODES = ("off", "ngram", "suffix")
FILES = [DATASETS / "mt_bench_questions.jsonl", DATASETS / "HumanEval.jsonl.gz"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen2.5-coder-0.5b",
                   help="target model (catalog name, GGUF, folder) whose chat template writes tool calls")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the engine config every mode starts from")
    p.add_argument("--dtype", choices=["fp32", "bf16"], help="override the config's dtype")
    p.add_argument("--conversations", type=int, default=8, help="conversations per concurrency and mode")
    p.add_argument("--concurrency", default="1,8", help="conversations at once (comma-separated)")
    p.add_argument("--max-turns", type=int, default=3, help="model turns per conversation at most")
    p.add_argument("--max-tokens", type=int, default=160,
                   help="tokens each turn generates at most (enough for a whole call or a short answer)")
    p.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)} (comma-separated)")
    p.add_argument("--k", type=int, help="override the config's speculation k")
    p.add_argument("--repeats", type=int, default=1, help="rounds of every mode (the order rotates)")
    p.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per instance")
    p.add_argument("--state", type=Path, default=local_cluster.DEFAULT_STATE, help="the local cluster's state file")
    p.add_argument("--json", type=Path)


def engine_for(base, mode: str, k: int | None):
    """The config's engine with this mode's speculation (off; or the config's policy with n-gram or suffix)."""
    spec = base.speculation
    if mode == "off":
        spec = spec.model_copy(update={"policy": "off"})
    else:
        policy = spec.policy if spec.policy != "off" else "goodput"
        spec = spec.model_copy(update={"method": mode, "policy": policy, **({"k": k} if k is not None else {})})
    return base.model_copy(update={"speculation": spec})


class Mode:
    """One mode's served instance, and its chat turn through the frontend."""

    def __init__(self, name: str, cfg, node: str, num_layers: int, args) -> None:
        self.name, self.args = name, args
        self.fleet = Fleet(cfg, RouterConfig(stats_interval_s=0.2), [node], 1, num_layers, args.num_cpus)
        self.tools = [Tool.model_validate(t) for t in TOOLS]

    async def chat(self, messages: list[dict], choice: str) -> TurnOut:
        f = self.fleet.frontend
        # one call per turn (`parallel_tool_calls: false`), as a ReAct-style agent loop asks: with parallel calls
        # allowed, the 0.5B model repeats its call until the token limit cuts the turn (docs/benchmarks.md, issue 38)
        plan_ = plan(self.tools, choice, False)
        shape, spec, _ = f.formats.shape(plan_, None, None, f.model_name)
        ids = await f.encode_chat(messages, "", template_tools(plan_))
        prep = f.prepare(ids, max_tokens=self.args.max_tokens, seed=None, n=1, priority=0, temperature=0.0,
                         top_p=1.0, top_k=0, stop=(), ignore_eos=False, structured=spec)
        call = await f.start(prep)
        text, tokens, finish, stats = "", [], None, None
        async for _, item in call:
            text += item.delta.text
            tokens += item.delta.token_ids
            if item.delta.finished:
                finish, stats = item.delta.finish_reason, item.stats
                if finish == FinishReason.ERROR:
                    raise RuntimeError(f"{self.name}: a turn failed: {item.delta.error}")
        message, called = shape.message(text, tokens) if shape is not None else (
            {"role": "assistant", "content": text}, False)
        return TurnOut(message, tuple(tokens), called, finish.value, stats.proposed if stats else 0,
                       stats.accepted if stats else 0)

    def close(self) -> None:
        self.fleet.close()


def run(args: argparse.Namespace) -> int:
    modes = [m for m in args.modes.split(",") if m]
    levels = [int(c) for c in args.concurrency.split(",") if c]
    if not modes or not set(modes) <= set(MODES) or "off" not in modes:
        raise UsageError(f"--modes: off and any of ngram, suffix; got {args.modes!r}")
    if not levels or min(levels) < 1 or args.max_turns < 2 or args.conversations < 1:
        raise UsageError("--concurrency: positive integers; --max-turns: at least 2 (a call, then an answer)")
    base = load_config(args.config).engine
    # the config's `auto` resolved here as the app resolves it (the model store converts per concrete dtype)
    dtype = args.dtype or choose_dtype(base.model.dtype, device=base.model.device)[0]
    model = base.model.model_copy(update={"dtype": dtype, "draft": None})
    target = resolve_model(args.model, model.dtype)
    base = base.model_copy(update={"model": model.model_copy(update={"target": target, "name": "agent-bench"})})
    questions = load_prompts(FILES, args.conversations)
    corpus = load_prompts(FILES, 64)
    state = local_cluster.read_state(args.state)
    local_cluster.connect(state, logging_level="ERROR", log_to_driver=False)
    meta = load_metadata(target, model.dtype)
    nodes = [n.spec.name for n in state.nodes]
    report: dict = {"model": args.model, "dtype": model.dtype, "deterministic": base.deterministic,
                    "conversations": args.conversations, "max_turns": args.max_turns, "max_tokens": args.max_tokens,
                    "load_average": os.getloadavg(), "levels": {}}
    served: dict[str, Mode] = {}
    try:
        for i, name in enumerate(modes):  # the modes' instances on the nodes in turn (each reserves --num-cpus)
            served[name] = Mode(name, engine_for(base, name, args.k), nodes[i % len(nodes)],
                                meta.config.num_hidden_layers, args)
        for name, mode in served.items():  # warm-up: a turn outside the figures
            asyncio.run(mode.chat([{"role": "user", "content": "Warm up."}], "auto"))
        for c in levels:
            runs: dict[str, list] = {m: [] for m in modes}
            for r in range(args.repeats):
                for name in modes[r % len(modes):] + modes[:r % len(modes)]:
                    convs, seconds = asyncio.run(run_workload(questions, served[name].chat, corpus, c,
                                                              args.max_turns))
                    runs[name].append((convs, seconds))
                    f = figures(convs, seconds)
                    print(f"concurrency {c}, round {r + 1}, {name}: {f['turns']} turns, {f['tokens']} tokens in "
                          f"{seconds:.1f} s ({f['tok_s']} tok/s)", flush=True)
            report["levels"][str(c)] = _compare(c, runs)
    finally:
        for mode in served.values():
            mode.close()
        ray.shutdown()
    report["load_average_after"] = os.getloadavg()
    save(report, args.json, None, lambda *_: None)
    return 0 if all(level["identical"] for level in report["levels"].values()) else 1


def _compare(concurrency: int, runs: dict[str, list]) -> dict:
    """Per mode: the figures over its rounds (each round's conversations and seconds), the ratios to `off`, and
    whether every turn's tokens agree with `off`'s."""
    rows = {}
    outputs = {}
    for name, rounds in runs.items():
        convs = [c for cs, _ in rounds for c in cs]
        rows[name] = figures(convs, sum(s for _, s in rounds))
        outputs[name] = [[t.token_ids for t in c.turns] for c in convs]
    identical = all(o == outputs["off"] for o in outputs.values())
    off = rows["off"]
    for name, row in rows.items():
        row["speedup_tok_s"] = round(row["tok_s"] / off["tok_s"], 3)
        row["speedup_turn"] = round(off["turn_s_mean"] / row["turn_s_mean"], 3)
    cols = ("turns", "calls", "cut", "answered", "tokens", "tok/s", "turn mean s", "turn p50 s", "accept", "x tok/s",
            "x turn")
    t = table("mode", *cols, title=f"agent loop, concurrency {concurrency}: outputs identical across modes: {identical}",
              right=cols)
    for name, r in rows.items():
        t.add_row(name, str(r["turns"]), str(r["calls"]), str(r["cut"]), str(r["answered"]), str(r["tokens"]),
                  f"{r['tok_s']:.1f}",
                  f"{r['turn_s_mean']:.2f}", f"{r['turn_s_p50']:.2f}",
                  "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}", f"{r['speedup_tok_s']:.2f}",
                  f"{r['speedup_turn']:.2f}")
    show(t)
    goal = 1.5 if concurrency == 1 else 1.0
    best = max((r["speedup_tok_s"] for n, r in rows.items() if n != "off"), default=None)
    print(f"  best speculation / off at concurrency {concurrency}: {best}x tokens/s (goal >= {goal})", flush=True)
    return {"runs": rows, "identical": identical}

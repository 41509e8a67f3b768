"""`specfleet bench lookup`: n-gram prompt-lookup drafts' acceptance by the n of their match, position by position.

The target's greedy outputs are what verification at temperature 0 accepts, so a draft's fate can be read off
them without running the verifier: at each point of an output, the n-gram lookup (actors/speculation/lookup.py)
proposes up to k tokens after the longest matching n-gram of the prompt and the output so far, and the accepted
drafts are the proposal's prefix that the output continues with. Rounds then move on by what was accepted plus the
target's own token, as an engine's do. The per-class figures are what the planner's estimate learns online
(actors/speculation/evidence.py); they say where drafting can pay in a full batch (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from actors.engine.core import Engine
from actors.engine.offline import generate
from actors.model.loader import load_model
from actors.model.runner import ModelRunner
from actors.speculation.evidence import PositionRates
from actors.speculation.lookup import NgramIndex
from cluster.config import CacheConfig, NgramConfig, SchedulerConfig, SpeculationConfig
from cluster.request import SamplingParams
from deploy.bench.output import save
from deploy.bench.prompts import DATASETS, load_prompts
from deploy.model_store import resolve_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2-135m-instruct", help="catalog name, GGUF file or folder")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--weights", choices=["dequantized", "stored", "int8", "int4"], default="stored")
    p.add_argument("--prompts", type=Path, nargs="+",
                   default=[DATASETS / "mt_bench_questions.jsonl", DATASETS / "HumanEval.jsonl.gz"])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4, help="drafts a round proposes at most")
    p.add_argument("--json", type=Path, help="write the results here")


@dataclass
class MatchClass:
    """Rounds whose drafts followed an n-gram of one n: per position, rounds that reached it and accepted it (the
    planner's per-position counts, actors/speculation/evidence.py, kept whole: no decay)."""

    rounds: int = 0
    accepted: int = 0  # draft tokens accepted, all rounds
    counts: PositionRates = field(default_factory=PositionRates)

    def add(self, proposed: int, accepted: int) -> None:
        self.rounds += 1
        self.accepted += accepted
        self.counts.update(proposed, accepted, decay=1.0)

    def rates(self) -> list[float]:
        """Per position, P(accepted | every earlier draft accepted)."""
        return [s / t for s, t in zip(self.counts.successes, self.counts.trials)]


def acceptance_by_match(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], k: int,
                        ngram: NgramConfig) -> tuple[dict[int, MatchClass], int]:
    """Per matched n, what greedy verification would accept of the lookup's drafts along each output; and the
    rounds in all (with a match or not)."""
    classes: dict[int, MatchClass] = {}
    rounds = 0
    for prompt, output in zip(prompts, outputs):
        index, t = NgramIndex(ngram.min_n, ngram.max_n), 0
        while t < len(output):
            rounds += 1
            drafts, n = index.match(list(prompt) + list(output[:t]), min(k, len(output) - t - 1))
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == output[t + accepted]:
                accepted += 1
            if drafts:
                classes.setdefault(n, MatchClass()).add(len(drafts), accepted)
            t += accepted + 1
    return classes, rounds


def run(args: argparse.Namespace) -> int:
    target = load_model(resolve_model(args.target, args.dtype), args.dtype, "cpu", args.weights)
    prompts = [target.encode(p, chat=True) for p in load_prompts(args.prompts, args.num_prompts)]
    cache = CacheConfig(block_size=16, num_blocks=(8 * (args.max_tokens + 1024)) // 16 + 64)
    engine = Engine(ModelRunner(target, range(target.num_layers), cache, deterministic=True), None,
                    SpeculationConfig(policy="off"), SchedulerConfig(max_batch_size=8), deterministic=True)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    outputs = [c.token_ids for i in range(0, len(prompts), 8) for c in generate(engine, prompts[i:i + 8], params)]
    ngram = NgramConfig()
    classes, rounds = acceptance_by_match(prompts, outputs, args.k, ngram)
    table = Table(title=f"n-gram lookup ({ngram.min_n}..{ngram.max_n}) on {args.target}'s greedy outputs: "
                        f"{len(prompts)} prompts x {args.max_tokens} tokens, {rounds} rounds")
    for col in ["matched n", "rounds", "share of rounds", "accepted a round"] + [f"P(pos {j + 1})" for j in range(args.k)]:
        table.add_column(col, justify="right")
    report = {"command": "specfleet bench lookup", "target": args.target, "rounds": rounds, "classes": {}}
    for n in sorted(classes):
        c = classes[n]
        rates = c.rates()
        table.add_row(str(n), str(c.rounds), f"{c.rounds / rounds:.2f}", f"{c.accepted / c.rounds:.2f}",
                      *[f"{r:.2f}" for r in rates], *["-"] * (args.k - len(rates)))
        report["classes"][n] = {"rounds": c.rounds, "accepted_per_round": round(c.accepted / c.rounds, 3),
                                "position_rates": [round(r, 3) for r in rates]}
    Console().print(table)
    save(report, args.json, None, lambda *_: None)
    return 0

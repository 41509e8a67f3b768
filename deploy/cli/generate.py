"""`specfleet generate`: offline generation in one process, printing text or one JSON object per prompt."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from actors.model.device import describe_compute
from actors.engine.core import Engine
from actors.engine.offline import generate
from cluster.request import SamplingParams, SpecStats
from deploy import model_store
from deploy.cli.flags import UsageError, add_engine_flags, engine_config
from deploy.serve.fleet import resolved


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_flags(p)
    g = p.add_argument_group("prompts and sampling")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    src.add_argument("--prompts-file", type=Path, help="JSONL: objects with 'prompt' (HumanEval) or 'turns' (MT-Bench)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--no-chat", action="store_true", help="send prompts raw instead of through the chat template")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")


def read_prompts(path: Path) -> list[str]:
    """Prompts from JSONL: a string, or an object with 'prompt' or 'turns' (the first turn)."""
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{n}: not JSON: {e}") from None
        if isinstance(obj, dict):
            obj = obj.get("prompt") or (obj.get("turns") or [None])[0]
        if not isinstance(obj, str):
            raise UsageError(f"{path}:{n}: expected a string or an object with 'prompt' or 'turns'")
        prompts.append(obj)
    return prompts


def run(args: argparse.Namespace) -> int:
    cfg = engine_config(args)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        max_tokens=args.max_tokens, stop=tuple(args.stop),
    )
    prompts = args.prompt or read_prompts(args.prompts_file)
    t0 = time.perf_counter()
    engine = Engine.from_config(resolved(cfg), calibration_dir=model_store.calibration_dir())
    load_s = time.perf_counter() - t0
    target = engine.target
    print(f"[target {cfg.model.target}: {target.model.plan.describe()}; "
          f"{describe_compute(target.model.dtype, target.device)}]", file=sys.stderr)
    token_ids = [engine.target.model.encode(p, chat=not args.no_chat) for p in prompts]  # raw where there is no template
    t0 = time.perf_counter()
    results = generate(engine, token_ids, params)
    gen_s = time.perf_counter() - t0
    for prompt, r in zip(prompts, results):
        if args.json:
            print(json.dumps({
                "prompt": prompt, "token_ids": r.token_ids, "text": r.text,
                "finish_reason": r.finish_reason.value if r.finish_reason else None,
                "error": r.error, "stats": r.stats.as_dict(),
            }))
        else:
            print(f"### {prompt}\n{r.text}\n")
    if not args.json:
        n = sum(len(r.token_ids) for r in results)
        s = SpecStats()
        for r in results:
            s.merge(r.stats)
        print(f"[{n} tokens in {gen_s:.1f}s ({n / gen_s:.1f} tok/s), model loaded in {load_s:.1f}s; "
              f"k={engine.k}, acceptance {s.acceptance_rate:.2f}, mean accepted length {s.mean_accepted_length:.2f}]",
              file=sys.stderr)
    return 1 if any(r.error for r in results) else 0

"""Flags shared by commands that build an engine, and their translation into the typed EngineConfig."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from cluster.config import ConfigError, EngineConfig, load_config, parse_config

M = TypeVar("M", bound=BaseModel)


class UsageError(ValueError):
    """Bad command-line input that is not a config problem (an unreadable prompts file, say)."""


def parse_layers(text: str) -> tuple[int, ...]:
    """'0-9,28,29' -> (0, 1, ..., 9, 28, 29)."""
    layers: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            layers.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad layer list {text!r}; expected e.g. 0-9,28,29") from None
    return tuple(layers)


def parse_numbers(text: str, flag: str, kind: type[int] | type[float], example: str) -> list:
    """A flag's comma-separated numbers: '256,1024' -> [256, 1024] (empty items skipped). UsageError naming the flag
    and `example` (what it takes, e.g. 'counts like 2,3') if one is not a number of `kind`."""
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag}: expected {example}, got {text!r}") from None


def read_json_file(path: Path, model: type[M], missing: str, what: str) -> M:
    """The file at `path` as a `model`; UsageError saying `missing` if there is no such file, or that it is not `what`
    (with its first problems)."""
    try:
        return model.model_validate_json(path.read_text())
    except FileNotFoundError:
        raise UsageError(missing) from None
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or '<root>'}: {err['msg']}" for err in e.errors()[:3])
        raise UsageError(f"{path}: not {what} ({problems})") from None


def parse_balance(text: str) -> float | None:
    """An expert grouping's load balance (placement/experts.py group_experts): '0.5' -> 0.5, 'none' -> None."""
    if text == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise argparse.ArgumentTypeError(f"bad balance {text!r}; expected a share >= 0 such as 0.5, or none")
    return value


def add_engine_flags(p: argparse.ArgumentParser, *, default_dtype: str | None = None) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--config", help="YAML config (deploy/configs/default.yaml); flags below override it")
    g.add_argument("--target", help="target model: catalog name, GGUF file, HF folder, or hub id")
    g.add_argument("--draft", help="draft model (same forms as --target), or 'none' for no speculation")
    g.add_argument("--draft-layers", type=parse_layers, help="self-speculative draft from these target layers")
    g.add_argument("--draft-quantization", choices=["none", "int8", "int4"],
                   help="the draft re-quantized at load: weight-only int8 or int4")
    g.add_argument("--weights", choices=["stored", "dequantized", "int8", "int4"],
                   help="stored: compute on a GGUF file's quantized weights as stored; dequantized: on weights "
                        "expanded to --dtype; int8 / int4: quantized at load")
    g.add_argument("--backend", choices=["auto", "native", "generic"],
                   help="native: our hand-written layers (llama, mistral, mixtral, qwen2, qwen2_moe); generic: "
                        "transformers' own decoder layers on our cache (any decoder-only model); auto: native where "
                        "written, else generic")
    g.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default=default_dtype)
    g.add_argument("--k", type=int, help="draft tokens per round, the most with --policy goodput (0 = none)")
    g.add_argument("--policy", choices=["fixed", "off", "goodput"], help="speculation length policy")
    g.add_argument("--method", choices=["model", "ngram", "suffix"],
                   help="how drafts are made: the draft model, n-gram prompt lookup, or a suffix tree (no model)")
    g.add_argument("--max-batch-size", type=int)
    g.add_argument("--max-num-batched-tokens", type=int, help="target tokens per step (chunked prefill budget)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine config from --config (if any) with the flags applied on top, validated as one."""
    raw: dict = load_config(args.config).engine.model_dump() if args.config else {"model": {}}
    model = raw["model"]
    if args.target:
        model["target"] = args.target
    if args.draft is not None:
        model["draft"] = None if args.draft == "none" else args.draft
        model["draft_layers"] = None
        if args.draft == "none":
            raw.setdefault("speculation", {})["policy"] = "off"
    if args.draft_layers is not None:
        model["draft_layers"], model["draft"] = args.draft_layers, None
    for key in ("draft_quantization", "dtype", "weights", "backend"):
        if getattr(args, key) is not None:
            model[key] = getattr(args, key)
    if args.k is not None:
        raw.setdefault("speculation", {})["k"] = args.k
    if args.policy is not None:
        raw.setdefault("speculation", {})["policy"] = args.policy
    if getattr(args, "method", None) is not None:
        raw.setdefault("speculation", {})["method"] = args.method
    for key in ("max_batch_size", "max_num_batched_tokens"):
        if getattr(args, key) is not None:
            raw.setdefault("scheduler", {})[key] = getattr(args, key)
    if "target" not in model:
        raise ConfigError("no target model: pass --target or --config")
    return parse_config({"engine": raw}, source=args.config or "command line").engine

"""`specfleet bench start`: time to first token from a fresh process, cold (empty conversion cache) and warm.

Each start is a new Python process that does what `specfleet generate` does (resolve the models, build the
engine, encode one MT-Bench prompt with the one prompt rule, decode one token); its clock starts when the
parent spawns it, so interpreter start and imports count. Cold: the models directory is a fresh folder
holding links to the GGUF files, so the conversion to safetensors (actors/model/convert.py) is part of the
start. Warm: the same folder again, its conversions now cached. For `bench default` and the like, call
`measure_start(engine_config, prompt)`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from cluster.config import EngineConfig, ModelConfig, load_config
from deploy import DEFAULT_CONFIG
from deploy.bench.output import save
from deploy.bench.prompts import DATASETS, load_prompts
from deploy.cli.flags import UsageError

QWEN_PAIR = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")


@dataclass(frozen=True)
class StartTiming:
    """One process start, seconds from spawn: imports done, models resolved (converted), engine built, first token."""

    imported_s: float
    resolved_s: float
    loaded_s: float
    first_token_s: float


@dataclass(frozen=True)
class StartFigures:
    """A cold and a warm start of the same engine config, measured one after the other."""

    cold: StartTiming
    warm: StartTiming

    @property
    def speedup(self) -> float:
        return self.cold.first_token_s / self.warm.first_token_s


def measure_start(engine: EngineConfig, prompt: str, *, gguf_dir: Path | None = None) -> StartFigures:
    """Cold then warm time to first token of `engine` (catalog names or GGUF paths) on `prompt`.

    `gguf_dir` holds the catalog's GGUF files (default: the model store's cache_dir()); they are linked into a
    private models folder, so neither start reuses the user's conversion cache, and the folder is removed after.
    """
    from deploy import model_store

    source = gguf_dir or model_store.cache_dir()
    with tempfile.TemporaryDirectory(prefix="specfleet-start-") as work:
        models = Path(work) / "models"
        models.mkdir()
        for name in {engine.model.target, engine.model.draft} - {None}:
            if name in model_store.CATALOG:
                path = source / model_store.lookup(name).file_name
                if not path.is_file():
                    path = model_store.fetch_model(name)
                (models / path.name).symlink_to(path.resolve())
        cold = _one_start(engine, prompt, models)
        warm = _one_start(engine, prompt, models)
    return StartFigures(cold=cold, warm=warm)


def _one_start(engine: EngineConfig, prompt: str, models: Path) -> StartTiming:
    env = {**os.environ, "SPECFLEET_MODELS": str(models), "SPECFLEET_START_T0": repr(time.time())}
    spec = json.dumps({"engine": engine.model_dump(mode="json"), "prompt": prompt})
    proc = subprocess.run([sys.executable, "-m", "deploy.bench.start", "--probe", spec], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"start probe failed ({proc.returncode}):\n{tail}")
    return StartTiming(**json.loads(proc.stdout.strip().splitlines()[-1]))


def _probe(spec: str) -> None:
    """Inside the fresh process: what `specfleet generate` does, with a clock from the parent's spawn."""
    t0 = float(os.environ["SPECFLEET_START_T0"])
    from actors.engine import Engine
    from actors.offline import generate
    from cluster.request import SamplingParams
    from deploy import model_store
    from deploy.serve.fleet import resolved

    imported = time.time() - t0
    req = json.loads(spec)
    cfg = resolved(EngineConfig.model_validate(req["engine"]))
    resolved_at = time.time() - t0
    engine = Engine.from_config(cfg, calibration_dir=model_store.calibration_dir())
    loaded = time.time() - t0
    ids = engine.target.model.encode(req["prompt"], chat=True)
    [result] = generate(engine, [ids], SamplingParams(temperature=0.0, max_tokens=1))
    if result.error or len(result.token_ids) != 1:
        raise RuntimeError(f"first token not produced: {result.error or result.token_ids}")
    first = time.time() - t0
    print(json.dumps(asdict(StartTiming(round(imported, 2), round(resolved_at, 2), round(loaded, 2),
                                        round(first, 2)))))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the default app's config (its engine)")
    p.add_argument("--no-qwen", action="store_true", help=f"only the default app, not the {'/'.join(QWEN_PAIR)} pair")
    p.add_argument("--qwen-dtype", choices=["fp32", "bf16"], default=None, help="default: the config's dtype")
    p.add_argument("--json", type=Path)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    engine = load_config(args.config).engine
    cases = {"default app": engine}
    if not args.no_qwen:
        qwen = ModelConfig(target=QWEN_PAIR[0], draft=QWEN_PAIR[1], dtype=args.qwen_dtype or engine.model.dtype)
        model_draft = engine.speculation.model_copy(update={"method": "model"})  # the pair loads both models
        cases["qwen pair"] = engine.model_copy(update={"model": qwen, "speculation": model_draft})
    try:
        [prompt] = load_prompts([DATASETS / "mt_bench_questions.jsonl"], 1)
    except FileNotFoundError as e:
        raise UsageError(f"prompts not found: {e}") from None
    console = Console(stderr=True)
    figures = {}
    for name, cfg in cases.items():
        with console.status(f"{name}: cold then warm start"):
            figures[name] = measure_start(cfg, prompt)
    table = Table(title="time to first token from a fresh process (s)")
    for col in ("engine", "dtype", "start", "imports", "models resolved", "engine built", "first token"):
        table.add_column(col)
    for name, f in figures.items():
        for kind, t in (("cold", f.cold), ("warm", f.warm)):
            table.add_row(name, cases[name].model.dtype, kind, f"{t.imported_s:.1f}", f"{t.resolved_s:.1f}",
                          f"{t.loaded_s:.1f}", f"{t.first_token_s:.1f}")
    Console().print(table)
    for name, f in figures.items():
        print(f"{name}: warm start {f.speedup:.1f}x faster than cold ({f.warm.first_token_s:.1f} s vs "
              f"{f.cold.first_token_s:.1f} s)")
    report = {name: {"dtype": cases[name].model.dtype, "cold": asdict(f.cold), "warm": asdict(f.warm),
                     "speedup": round(f.speedup, 2)} for name, f in figures.items()}
    save(report, args.json, None, lambda *_: None)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--probe":
        _probe(sys.argv[2])
    else:
        raise SystemExit("usage: specfleet bench start (this module's own entry is the start probe)")

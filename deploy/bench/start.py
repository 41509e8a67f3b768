"""`specfleet bench start`: time to first token from a fresh process, cold (empty caches) and warm, phase by phase.

Each start is a new Python process that does what `specfleet generate` does (resolve the models, build the
engine, encode MT-Bench prompts with the one prompt rule, decode one token of each: 8 by default, a batch the
default app serves at once); its clock starts when the parent spawns it, so interpreter start and imports count.
Cold: the models directory is a fresh folder holding links to the GGUF files, so the conversion to safetensors
(actors/model/convert.py), the packing of the stored weights for our kernels (actors/model/layout_cache.py) and
the goodput calibration (actors/speculation/calibration.py) are part of the start; our CPU kernels are built once
per machine and are not (actors/model/kernel_build.py). Warm: the same folder again, all of those cached. The
engine's build is timed phase by phase as an instance's start is (actors/start_phases.py). A served instance adds
its Ray actor's start and Serve's health checks: `specfleet status` shows the last one's phases, and
`specfleet bench faults` a replacement's start. For `bench default` and the like, call
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cluster.config import EngineConfig, ModelConfig, load_config
from deploy import DEFAULT_CONFIG
from deploy.bench.output import save
from deploy.bench.prompts import DATASETS, load_prompts
from deploy.cli.flags import UsageError

QWEN_PAIR = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")


@dataclass(frozen=True)
class StartTiming:
    """One process start, seconds from spawn: imports done, models resolved (converted), engine built, first token
    (of every prompt); `phases`: the engine build's seconds phase by phase (actors/start_phases.py)."""

    imported_s: float
    resolved_s: float
    loaded_s: float
    first_token_s: float
    phases: dict[str, float] = field(default_factory=dict)

    def breakdown(self) -> dict[str, float]:
        """The whole start phase by phase, adding up to `first_token_s`."""
        built = self.loaded_s - self.resolved_s
        return {"process and imports": self.imported_s, "models resolved": self.resolved_s - self.imported_s,
                **self.phases, "other": max(0.0, built - sum(self.phases.values())),
                "first forward": self.first_token_s - self.loaded_s}


@dataclass(frozen=True)
class StartFigures:
    """A cold and a warm start of the same engine config, measured one after the other."""

    cold: StartTiming
    warm: StartTiming

    @property
    def speedup(self) -> float:
        return self.cold.first_token_s / self.warm.first_token_s


def measure_start(engine: EngineConfig, prompt: str | list[str], *, gguf_dir: Path | None = None) -> StartFigures:
    """Cold then warm time to first token of `engine` (catalog names or GGUF paths) on `prompt` (or each of them).

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


def _one_start(engine: EngineConfig, prompt: str | list[str], models: Path) -> StartTiming:
    env = {**os.environ, "SPECFLEET_MODELS": str(models), "SPECFLEET_START_T0": repr(time.time())}
    prompts = [prompt] if isinstance(prompt, str) else prompt
    spec = json.dumps({"engine": engine.model_dump(mode="json"), "prompts": prompts})
    proc = subprocess.run([sys.executable, "-m", "deploy.bench.start", "--probe", spec], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"start probe failed ({proc.returncode}):\n{tail}")
    return StartTiming(**json.loads(proc.stdout.strip().splitlines()[-1]))


def _probe(spec: str) -> None:
    """Inside the fresh process: what `specfleet generate` does, with a clock from the parent's spawn."""
    t0 = float(os.environ["SPECFLEET_START_T0"])
    from actors.engine.core import Engine
    from actors.engine.offline import generate
    from actors.start_phases import StartClock
    from cluster.request import SamplingParams
    from deploy import model_store
    from deploy.serve.fleet import resolved

    imported = time.time() - t0
    req = json.loads(spec)
    cfg = resolved(EngineConfig.model_validate(req["engine"]))
    resolved_at = time.time() - t0
    with StartClock().current() as clock:
        engine = Engine.from_config(cfg, calibration_dir=model_store.calibration_dir())
    loaded = time.time() - t0
    ids = [engine.target.model.encode(p, chat=True) for p in req["prompts"]]
    results = generate(engine, ids, SamplingParams(temperature=0.0, max_tokens=1))
    if any(r.error or len(r.token_ids) != 1 for r in results):
        raise RuntimeError(f"first token not produced: {[r.error or r.token_ids for r in results]}")
    first = time.time() - t0
    phases = {name: round(seconds, 2) for name, seconds in clock.result().phases}
    print(json.dumps(asdict(StartTiming(round(imported, 2), round(resolved_at, 2), round(loaded, 2),
                                        round(first, 2), phases))))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the default app's config (its engine)")
    p.add_argument("--prompts", type=int, default=8, help="prompts decoded to their first token, at once")
    p.add_argument("--no-qwen", action="store_true", help=f"only the default app, not the {'/'.join(QWEN_PAIR)} pair")
    p.add_argument("--qwen-dtype", choices=["fp32", "bf16"], default=None, help="default: the config's dtype")
    p.add_argument("--json", type=Path)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    if args.prompts < 1:
        raise UsageError(f"--prompts must be at least 1, got {args.prompts}")
    engine = load_config(args.config).engine
    cases = {"default app": engine}
    if not args.no_qwen:
        qwen = ModelConfig(target=QWEN_PAIR[0], draft=QWEN_PAIR[1], dtype=args.qwen_dtype or engine.model.dtype)
        model_draft = engine.speculation.model_copy(update={"method": "model"})  # the pair loads both models
        cases["qwen pair"] = engine.model_copy(update={"model": qwen, "speculation": model_draft})
    try:
        prompts = load_prompts([DATASETS / "mt_bench_questions.jsonl"], args.prompts)
    except FileNotFoundError as e:
        raise UsageError(f"prompts not found: {e}") from None
    console = Console(stderr=True)
    figures = {}
    for name, cfg in cases.items():
        with console.status(f"{name}: cold then warm start"):
            figures[name] = measure_start(cfg, prompts)
    dtypes = {name: _dtype(cfg.model) for name, cfg in cases.items()}  # `auto` as it resolves on this machine
    for name, f in figures.items():
        cold, warm = f.cold.breakdown(), f.warm.breakdown()
        table = Table(title=f"{name} ({dtypes[name]}): a start from a fresh process to the first token "
                            f"of {len(prompts)} prompts, phase by phase (s)")
        for col in ("phase", "cold", "warm"):
            table.add_column(col, justify="left" if col == "phase" else "right")
        for phase in dict.fromkeys([*cold, *warm]):
            table.add_row(phase, f"{cold.get(phase, 0.0):.2f}", f"{warm.get(phase, 0.0):.2f}")
        table.add_row("first token", f"{f.cold.first_token_s:.2f}", f"{f.warm.first_token_s:.2f}", style="bold")
        Console().print(table)
        print(f"{name}: warm start {f.speedup:.1f}x faster than cold ({f.warm.first_token_s:.1f} s vs "
              f"{f.cold.first_token_s:.1f} s)")
    report = {name: {"dtype": dtypes[name], "prompts": len(prompts), "load_average": os.getloadavg(),
                     "cold": asdict(f.cold), "warm": asdict(f.warm), "speedup": round(f.speedup, 2)}
              for name, f in figures.items()}
    save(report, args.json, None, lambda *_: None)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--probe":
        _probe(sys.argv[2])
    else:
        raise SystemExit("usage: specfleet bench start (this module's own entry is the start probe)")


def _dtype(model: ModelConfig) -> str:
    """The dtype a start of `model` computes in: `auto` chosen as the app would on this machine."""
    from actors.model.device import choose_dtype

    return choose_dtype(model.dtype, device=model.device)[0]

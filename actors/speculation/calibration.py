"""A machine's goodput calibration kept on disk: the engine's timed forwards, saved under what sets their times.

The goodput policy needs the step-time model (actors/speculation/cost_model.py) before its first step, so
Engine.calibrate times forwards at the model's knots: about 1.4 s of every start of the default app on a
2-core CPU, a quarter of its time to first token. Those times depend on the weights and the layers run, the
dtype, the device, the CPU, the torch threads and, on a CPU, which kernels compute (ours, by the digest of
their sources, or torch's): that is the key (`setup`). A start whose setup matches a saved one refits from the
saved points instead of timing again, and its online window then follows drift exactly as after a fresh
calibration. As with an autotuner's cache (TensorRT's timing cache, Triton's
autotune cache), a stale entry costs accuracy, never correctness: the policy only picks how many tokens to
draft, and verification keeps the output lossless whatever it picks.

A file is trusted only if it parses, has this module's FORMAT and holds exactly the setup asked for; anything
else is logged, ignored and overwritten by the next calibration. Writes go to a temporary file renamed into
place, so a reader sees no file or a whole one. Delete the folder to re-time everything.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import time
from collections.abc import Iterable

import torch

from actors.model.device import device_name
from actors.model import cpu_kernels
from actors.model.metadata import SeqChunk
from actors.speculation.cost_model import ATTENTION_UNIT, ForwardShape, StepCostModel
from cluster.config import EngineConfig

log = logging.getLogger(__name__)

FORMAT = 2  # bump when the points' meaning changes (the calibration sizes are part of the setup instead)
# (new tokens, context before them) of each timed forward: every knot of the cost model's basis, and long contexts
# for attention; each size is timed `REPEATS` times
SIZES = ((1, 32), (2, 32), (4, 32), (8, 32), (16, 32), (32, 32), (64, 0), (128, 0), (8, 128), (1, 256))
REPEATS = 2
_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")  # what sets CPU kernels


@dataclass(frozen=True)
class TimedForward:
    """One timed calibration forward of the target's or the draft's runner: one request, `tokens` new tokens."""

    phase: Literal["target", "draft"]
    tokens: int
    attention: float  # new tokens x (context + new tokens) / ATTENTION_UNIT, as ForwardShape.attention
    seconds: float


def model_identity(source: str) -> dict:
    """What names one checkpoint's contents: a file's or folder's path with its files' sizes and mtimes (a
    converted folder's name also holds its GGUF file's sha256), or a hub id as given."""
    path = Path(source).expanduser()
    if not path.exists():
        return {"source": source}
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return {"source": str(path.resolve()), "files": hashlib.sha256(repr(stats).encode()).hexdigest()[:16]}


def machine() -> dict:
    """The host facts forward times depend on: CPU model and its vector flags, torch version and threads."""
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name":
                cpu = value.strip()
            elif name.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:  # not Linux: the platform's processor string stands in
        pass
    return {"cpu": cpu, "cpu_flags": sorted(flags.intersection(_CPU_FLAGS)), "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def setup_of(cfg: EngineConfig, device: torch.device) -> dict:
    """The key of an engine's calibration built from `cfg` (models resolved) on `device` in this process."""
    m = cfg.model
    return {
        "target": model_identity(m.target), "draft": model_identity(m.draft) if m.draft else None,
        "draft_layers": m.draft_layers, "draft_quantization": m.draft_quantization, "dtype": m.dtype,
        "weights": m.weights, "activations": m.activations,
        "max_model_len": m.max_model_len, "method": cfg.speculation.method,
        "draft_parallel": cfg.speculation.draft_parallel.model_dump(mode="json"),
        "block_size": cfg.cache.block_size, "device": device_name(device), "machine": machine(),
        # a kernel change (or SPECFLEET_CPU_KERNELS=torch) changes the forward times as much as another CPU would
        "kernels": cpu_kernels.identity() if device.type == "cpu" else None,
        "sizes": SIZES, "repeats": REPEATS,
    }


class CalibrationFile:
    """The saved calibration of one setup (a JSON-able mapping), as a file under `root` named by its hash."""

    def __init__(self, root: Path, setup: Mapping) -> None:
        self.setup = json.loads(json.dumps(setup, sort_keys=True))  # canonical, and what a reload compares with
        digest = hashlib.sha256(json.dumps(self.setup, sort_keys=True).encode()).hexdigest()
        self.path = Path(root) / f"{digest[:32]}.json"

    def load(self) -> list[TimedForward] | None:
        """The saved points, or None when there is no usable file for this setup (the reason is logged)."""
        try:
            saved = json.loads(self.path.read_text())
            if saved.get("format") != FORMAT or saved.get("setup") != self.setup:
                raise ValueError("written for another format or setup")
            points = [TimedForward(**p) for p in saved["points"]]
            if not points or any(p.phase not in ("target", "draft") or not p.seconds > 0 for p in points):
                raise ValueError("no points, or a point with an unknown phase or a non-positive time")
            return points
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            log.warning("calibration file %s is not usable (%s): timing again", self.path, e)
            return None

    def save(self, points: list[TimedForward]) -> None:
        """Write the points atomically (a temporary file renamed into place)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = json.dumps({"format": FORMAT, "setup": self.setup, "points": [asdict(p) for p in points]}, indent=1)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.stem}-", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(body)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def time_forwards(runners: Iterable[tuple[Literal["target", "draft"], object]], max_model_len: int
                  ) -> list[TimedForward]:
    """Time one forward of a throwaway request at each of SIZES (new tokens, context) on each runner."""
    return [p for phase, runner in runners for size in SIZES * REPEATS
            if (p := time_one(phase, runner, size, max_model_len)) is not None]


def time_one(phase: Literal["target", "draft"], runner, size: tuple[int, int], max_model_len: int  # noqa: ANN001
             ) -> TimedForward | None:
    """One timed forward of `size` (new tokens, context) on `runner`, its throwaway request freed after it (so the
    engine may step between two of them); None where the size does not fit.

    The timed forward follows an untimed one of the same size: the first forward after a longer one is a transient
    that steady steps do not pay (the Qwen 1.5B target's one-token decode took 171-209 ms right after a 32-256-token
    forward and 102-118 ms in the steps after it, docs/scheduler.md), and a calibration that timed it predicted a
    decode step 16-22% too slow, which made drafts look cheap."""
    rid, (new, ctx) = "__calibration__", size
    if ctx + 2 * new > max_model_len or not runner.reserve(rid, ctx + 2 * new):
        return None
    try:
        if ctx:  # context to attend to (not timed)
            runner.forward([SeqChunk(rid, tuple(range(1, ctx + 1)), 0)])
        chunk = [SeqChunk(rid, tuple(range(1, new + 1)))]
        runner.forward(chunk)  # the same size, not timed
        t0 = time.perf_counter()
        runner.forward(chunk)
        seconds = time.perf_counter() - t0
    finally:
        runner.cache.free(rid)
    return TimedForward(phase, new, new * (ctx + 2 * new) / ATTENTION_UNIT, seconds)


def seed(cost: StepCostModel, points: Iterable[TimedForward]) -> None:
    """Pin calibration points in the step-time model (each refits it)."""
    models = {"target": cost.target, "draft": cost.draft}
    for p in points:
        models[p.phase].observe(ForwardShape(1, p.tokens, p.attention), p.seconds, pinned=True)


def calibrate(cost: StepCostModel, runners: list[tuple[Literal["target", "draft"], object]], max_model_len: int,
              saved: "CalibrationFile | None") -> None:
    """Seed the step-time model with timed forwards of a throwaway request at a few sizes (pinned points), or
    with the points `saved` for this setup by an earlier start (and save fresh ones there)."""
    points = saved.load() if saved is not None else None
    fresh = points is None
    if fresh:
        points = time_forwards(runners, max_model_len)
    seed(cost, points)
    if fresh and saved is not None:
        saved.save(points)


class Pending:
    """A calibration timed off the start's critical path: one forward per `step`, run by the serving loop while the
    instance has no request (actors/serving/loop.py, `idle`), so a request that arrives waits for one forward at most.
    Until it is done the policy runs on what it has (the steps it has seen: actors/speculation/cost_model.py fits
    them online; with none, it drafts nothing, which is plain decoding and lossless). Done, its points are pinned
    and saved for the next start (`saved`)."""

    def __init__(self, cost: StepCostModel, runners: list[tuple[Literal["target", "draft"], object]],
                 max_model_len: int, saved: "CalibrationFile | None") -> None:
        self.cost, self.max_model_len, self.saved = cost, max_model_len, saved
        self._todo = [(phase, runner, size) for phase, runner in runners for size in SIZES * REPEATS]
        self.points: list[TimedForward] = []

    @property
    def done(self) -> bool:
        return not self._todo

    def step(self) -> bool:
        """Time the next forward; True while more remain (the last one seeds the model and saves the points)."""
        if self._todo:
            phase, runner, size = self._todo.pop(0)
            if (p := time_one(phase, runner, size, self.max_model_len)) is not None:
                self.points.append(p)
            if not self._todo:
                seed(self.cost, self.points)
                if self.saved is not None and self.points:
                    self.saved.save(self.points)
                log.info("goodput calibration done off the critical path: %d forwards timed", len(self.points))
        return not self.done

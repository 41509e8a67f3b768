"""The in-process stage executor: a model's stages as ModelRunners in this process, activations handed straight on.

It is the StageExecutor (actors/pipeline.py) an instance drives when all its shards sit in the instance's own
process (one device, or a test); actors/ray_stages.py is the one for shards in Ray actors. Both replay the
driver's cache ops on every stage before they run, and both turn a stage that fails or was stopped into a
ShardFailure naming it, so the instance (actors/instance.py) treats a failure the same way in either shape.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from actors.device import resolve_device
from actors.instance import Instance
from actors.kv_cache import KVExport
from actors.kv_ledger import CacheOp, replay
from actors.kv_links import KVPorts, LinkedKV, LinkPart, import_stage, send_stage
from actors.model.loader import load_model
from actors.model.metadata import SeqChunk
from actors.model.quant import quantize_runner
from actors.model.runner import ModelRunner
from actors.p2p import free_address
from actors.pipeline import PipelineRunner, ShardFailure
from actors.spec import easyspec
from cluster.config import ConfigError, EngineConfig
from cluster.migration import Link


class LocalStages:
    """StageExecutor over ModelRunners of one process, in pipeline order; `names` label them in errors. A
    migration's links to or from its stages end in this process (`ports`)."""

    exports_kv = True
    kv_links = True

    def __init__(self, runners: Sequence[ModelRunner], names: Sequence[str] | None = None) -> None:
        if not runners:
            raise ValueError("an executor needs at least one stage")
        self.runners: list[ModelRunner | None] = list(runners)
        self.names = list(names) if names is not None else [f"stage {i} (in process)" for i in range(len(runners))]
        if len(self.names) != len(self.runners):
            raise ValueError("one name per stage")
        self.layer_ids = [tuple(r.layer_ids) for r in runners]
        self.calls = 0
        self.ports = KVPorts()

    def run(self, ops: list[CacheOp], chunks: list[SeqChunk], parallel: bool = False) -> torch.Tensor | None:
        """Replay `ops` on every stage, then run `chunks` through them in order: logits (sum num_logits, V)."""
        self.calls += 1
        runners = self._replay(ops, "step")
        if not chunks:
            return None
        x = None
        for name, r in zip(self.names, runners):
            try:
                x = r.forward(chunks, x, parallel)  # hidden (N, H), then logits (sum num_logits, V) from the last
            except Exception as e:  # noqa: BLE001 - any failure of a stage ends the instance, named
                raise ShardFailure(f"step: {name} failed: {type(e).__name__}: {e}") from e
        return x

    def export(self, ops: list[CacheOp], request_id: str, start: int, end: int) -> list[KVExport]:
        return [r.cache.export(request_id, start, end) for r in self._replay(ops, "KV export")]

    def import_(self, ops: list[CacheOp], exports: list[KVExport]) -> bool:
        runners = self._replay(ops, "KV import")
        return all([r.cache.import_(e) for r, e in zip(runners, exports, strict=True)])

    def cache_usage(self, ops: list[CacheOp]) -> list[tuple[int, int]]:
        """(used, free) blocks of each stage's own cache, after replaying `ops`."""
        return [(r.cache.num_used_blocks, r.cache.num_free_blocks) for r in self._replay(ops, "cache usage")]

    # ---- a migration's links: every stage's end is in this process
    def kv_device(self) -> str:
        return self._replay([], "KV device")[0].cache.k.device.type

    def link_addresses(self, stages: list[int], host: str) -> list[str]:
        return [free_address(host) for _ in stages]

    def open_links(self, links: list[Link], side: str, timeout_s: float, backend: str) -> None:
        self.ports.open(links, side, timeout_s, backend)

    def send_links(self, ops: list[CacheOp], request_id: str, start: int, end: int,
                   links: list[Link]) -> list[LinkPart]:
        runners = self._replay(ops, "KV export")
        return [part for i, r in enumerate(runners)
                for part in send_stage(r.cache, self.ports, request_id, start, end, [k for k in links if k.src == i])]

    def receive_links(self, kv: LinkedKV) -> None:
        self.ports.receive(kv.parts)

    def import_links(self, ops: list[CacheOp], kv: LinkedKV) -> bool:
        runners = self._replay(ops, "KV import")
        return all([import_stage(r.cache, self.ports, kv.request_id, kv.start, [p for p in kv.parts if p.dst == i])
                    for i, r in enumerate(runners)])

    def close_links(self, prefix: str) -> None:
        self.ports.close(prefix)

    def kill(self, stages: Sequence[int] | None = None) -> None:
        """Stop the given stages (all by default): their weights and KV are released; calls then fail."""
        for i in range(len(self.runners)) if stages is None else stages:
            self.runners[i] = None

    def _replay(self, ops: list[CacheOp], what: str) -> list[ModelRunner]:
        dead = [name for name, r in zip(self.names, self.runners) if r is None]
        if dead:
            raise ShardFailure(f"{what}: {', '.join(dead)} was stopped")
        runners: list[ModelRunner] = list(self.runners)  # type: ignore[arg-type]  # none is None (checked above)
        for r in runners:
            replay(ops, r.cache)
        return runners


def load_runners(cfg: EngineConfig, stages: Sequence[tuple[int, int]] | None = None,
                 device: torch.device | str | None = None) -> tuple[list[ModelRunner], ModelRunner | None]:
    """Load `cfg`'s model pair in this process onto `device` (default: the config's `model.device`, resolved
    here): one runner per target stage (layer ranges [start, end); None: one stage of every layer) and the
    draft's runner (None when speculation is off or there is no draft).

    A self-speculative draft (`draft_layers`) shares the target's weights; a draft re-quantized at load
    (`draft_quantization`) is quantized here.
    """
    m = cfg.model
    device = resolve_device(m.device) if device is None else torch.device(device)
    target_model = load_model(m.target, m.dtype, device, m.weights)
    n = target_model.num_layers
    bounds = list(stages) if stages is not None else [(0, n)]
    last = len(bounds) - 1
    target = [ModelRunner(target_model, range(a, b), cfg.cache, first=i == 0, last=i == last)
              for i, (a, b) in enumerate(bounds)]
    if cfg.speculation.policy == "off" or cfg.speculation.method != "model":
        return target, None  # no draft model: plain decoding, or a model-free (lookup) drafter
    if m.draft is not None:
        draft_model = load_model(m.draft, m.dtype, device, m.weights)
        draft = ModelRunner(draft_model, range(draft_model.num_layers), cfg.cache)
    elif m.draft_layers is not None:
        if any(not 0 <= i < n for i in m.draft_layers):
            raise ConfigError(f"model.draft_layers: {list(m.draft_layers)} not within the target's {n} layers")
        draft = ModelRunner(target_model, m.draft_layers, cfg.cache)
    else:
        return target, None
    if m.draft_quantization != "none":
        quantize_runner(draft, m.draft_quantization)
    easyspec.enable(draft, cfg.speculation.draft_parallel)
    return target, draft


def local_instance(cfg: EngineConfig, stages: Sequence[tuple[int, int]] | None = None,
                   device: torch.device | str | None = None) -> Instance:
    """An Instance whose stages (and draft) all run in this process, on `device` (default: the config's)."""
    target, draft = load_runners(cfg, stages, device)
    pipeline = PipelineRunner(target[0].model, cfg.cache, LocalStages(target), target[-1].device)
    draft_pipeline = None
    if draft is not None:
        draft_pipeline = PipelineRunner(draft.model, cfg.cache, LocalStages([draft], ["draft (in process)"]),
                                        draft.device)
    return Instance(cfg, pipeline, draft_pipeline)

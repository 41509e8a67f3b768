"""One shard of a distributed instance: a ModelRunner over its layers only, its KV cache, and its process group.

What every shard is (`Shard`: load, join, replay cache ops, report its cache, copy its KV) and the pipeline's
role (`StageWorker`). A target pipeline stage holds a contiguous layer range (the first also embeds tokens, the
last also has the final norm and LM head); a lone draft shard holds the whole draft. Each step the stage replays
the cache ops its driver recorded (actors/kv/ledger.py), receives the previous stage's activations (unless first),
runs its layers, and sends the activations on (unless last) or returns the logits. The other roles are built on
the same `Shard`: an EasySpec draft group's leader and members (actors/shards/group.py) and an expert-parallel rank
(actors/shards/expert.py). The runner is the one the single-process engine uses: parallelism is applied from
outside it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from actors.model.device import resolve_device
from actors.kv.cache import KVExport
from actors.kv.ledger import CacheOp, replay
from actors.kv.links import KVPorts, LinkPart, import_stage, send_stage
from actors.model.loader import load_model
from actors.model.metadata import SeqChunk
from actors.model.quant import quantize_runner
from actors.model.runner import ModelRunner
from actors.moe.permute import apply_plan
from actors.transport.p2p import P2P, Transfer
from actors.speculation import easyspec
from cluster.config import CacheConfig, DraftParallelConfig
from cluster.migration_messages import Link, Side
from placement.experts import ExpertPlan

MAX_TRANSFERS = 10_000  # transfer records a shard keeps for benchmarks


@dataclass(frozen=True)
class ShardSpec:
    """What one shard loads: layers `layer_ids` of checkpoint `source`; it embeds if `first`, has the head if `last`.
    The roles that need more wrap it (MemberSpec, ExpertSpec)."""

    source: str
    dtype: str
    layer_ids: tuple[int, ...]
    first: bool
    last: bool
    cache: CacheConfig
    quantization: str = "none"  # "int8" / "int4": re-quantized at load (drafts only, see actors/model/quant.py)
    weights: str = "dequantized"  # engine.model.weights: how its linear maps compute (actors/model/weights.py)
    backend: str = "auto"  # engine.model.backend: the native or the generic path (actors/model/backends.py)
    activations: str = "int8"  # engine.model.activations: how our CPU int4 kernel takes their inputs (qlinear.py)
    device: str = "auto"  # engine.model.device, resolved in the shard's process (actors/model/device.py)
    deterministic: bool = False  # engine.deterministic: the batch-invariant forward (actors/model/deterministic.py)
    # where the last stage hands its logits to the driver: they cross processes through Ray's object store,
    # which is host memory, so the driver (which holds no GPU) reads them from the CPU
    logits_device: str = "cpu"
    # a draft's EasySpec layer groups, run by its runner (a group's leader computes them with its members)
    draft_parallel: DraftParallelConfig = DraftParallelConfig()


def load_shard(spec: ShardSpec, plan: ExpertPlan | None = None) -> ModelRunner:
    """Load the checkpoint, build the shard's runner, and drop every weight the shard does not run (`plan`: the
    expert plan an expert-parallel rank orders its experts by)."""
    # on the CPU: the runner moves only its own layers to its device
    model = load_model(spec.source, spec.dtype, weights=spec.weights, activations=spec.activations,
                       backend=spec.backend)  # type: ignore[arg-type]  # checked by the config
    runner = ModelRunner(model, spec.layer_ids, spec.cache, first=spec.first, last=spec.last,
                         device=resolve_device(spec.device), deterministic=spec.deterministic)
    hf = model.hf_model.model
    for i in range(model.num_layers):
        if i not in spec.layer_ids:
            hf.layers[i] = torch.nn.Identity()
    if not spec.first:
        hf.embed_tokens = None
    if not spec.last:
        hf.norm = None
        model.hf_model.lm_head = None  # a tied head shares the embedding's tensor: it stays if this shard is first
    if plan is not None:
        apply_plan(runner, plan)
    if spec.quantization != "none":
        quantize_runner(runner, spec.quantization)
    easyspec.enable(runner, spec.draft_parallel)
    return runner


class Shard:
    """What every shard does: load its runner (and cache) on `threads` torch threads, join its group's processes,
    replay the driver's cache ops, report its cache, copy its KV out and in. `_joined` is what a role does once it
    has its process group."""

    def __init__(self, spec: ShardSpec, threads: int = 1, plan: ExpertPlan | None = None) -> None:
        torch.set_num_threads(threads)
        self.runner = load_shard(spec, plan)
        self.logits_device = torch.device(spec.logits_device)
        self.p2p: P2P | None = None

    def join(self, init_method: str, rank: int, world_size: int, timeout_s: float, backend: str | None = None) -> str:
        """Join the group's processes as `rank` with `backend` (default: this shard's device's); returns the
        backend."""
        self.p2p = P2P(init_method, rank, world_size, timeout_s, self.runner.device, backend)
        self._joined(self.p2p)
        return self.p2p.backend

    def _joined(self, p2p: P2P) -> None:
        """A role's setup over its process group (nothing for a pipeline stage: it sends and receives per step)."""

    def device(self) -> str:
        """The device this shard computes on, e.g. "cpu" or "cuda:0"."""
        return str(self.runner.device)

    def backend(self) -> str | None:
        """The group's backend ("gloo" or "nccl"); None until joined (a lone stage never joins)."""
        return self.p2p.backend if self.p2p is not None else None

    def num_parameters(self) -> int:
        """Parameters this shard holds (each shared tensor once)."""
        hf = self.runner.model.hf_model
        return sum(p.numel() for p in hf.parameters())

    def cache_usage(self, ops: list[CacheOp]) -> tuple[int, int]:
        """Replay `ops`, then (used, free) blocks of this shard's cache."""
        replay(ops, self.runner.cache)
        return self.runner.cache.num_used_blocks, self.runner.cache.num_free_blocks

    def export(self, ops: list[CacheOp], request_id: str, start: int, end: int) -> KVExport:
        """Replay `ops`, then copy out KV of tokens [start, end) of a request for this shard's layers."""
        replay(ops, self.runner.cache)
        return self.runner.cache.export(request_id, start, end)

    def import_(self, ops: list[CacheOp], export: KVExport) -> bool:
        """Replay `ops` (they reserve the room), then write `export` (this shard's layers) after the request's KV."""
        replay(ops, self.runner.cache)
        return self.runner.cache.import_(export)

    @property
    def _p2p(self) -> P2P:
        if self.p2p is None:
            raise RuntimeError("this shard has not joined its group's processes")
        return self.p2p

    def close(self) -> None:
        if self.p2p is not None:
            self.p2p.close()
            self.p2p = None


class StageWorker(Shard):
    """A pipeline stage (or a lone draft shard): replays cache ops, receives activations, runs its layers, sends
    them on or returns logits; the end of a migration's links for its own layers."""

    def __init__(self, spec: ShardSpec, threads: int = 1) -> None:
        super().__init__(spec, threads)
        self.transfers: deque[Transfer] = deque(maxlen=MAX_TRANSFERS)
        self.ports = KVPorts()  # its ends of migrations' links (actors/kv/links.py)

    @torch.inference_mode()
    def step(self, ops: list[CacheOp], chunks: list[SeqChunk], parallel: bool = False) -> torch.Tensor | None:
        """Replay `ops`, then run `chunks` through this stage: logits (sum num_logits, V) if last, else None."""
        replay(ops, self.runner.cache)
        if not chunks:
            return None
        runner, hidden = self.runner, None
        if not runner.first:
            n = sum(len(c.token_ids) for c in chunks)
            # (N, H), received straight onto this shard's device (NCCL between GPUs, gloo otherwise)
            hidden, t = self._p2p.recv((n, runner.model.config.hidden_size), runner.model.dtype, self._p2p.rank - 1)
            self.transfers.append(t)
        out = runner.forward(chunks, hidden, parallel)  # logits (sum num_logits, V) if last, else hidden (N, H)
        if runner.last:
            return out.to(self.logits_device)  # to the driver (see ShardSpec.logits_device); a no-op on a CPU shard
        self.transfers.append(self._p2p.send(out, self._p2p.rank + 1))
        return None

    # a migration's links (actors/kv/links.py): `kv_open`, `kv_receive` and `kv_close` run beside the steps (the
    # actor's "kv" concurrency group), `kv_send` and `kv_import` between them, like `export` and `import_`
    def kv_open(self, links: list[Link], side: Side, timeout_s: float, backend: str) -> None:
        """Join `links` (this shard is their `side` end: SRC or DST)."""
        self.ports.open(links, side, timeout_s, backend)

    def kv_send(self, ops: list[CacheOp], request_id: str, start: int, end: int, links: list[Link]) -> list[LinkPart]:
        """Replay `ops`, then send this shard's KV of tokens [start, end) of a request over `links` (the sends go on
        after it returns); what each carried."""
        replay(ops, self.runner.cache)
        return send_stage(self.runner.cache, self.ports, request_id, start, end, links)

    def kv_receive(self, parts: list[LinkPart]) -> None:
        """Receive `parts` over their links (blocking until they are in)."""
        self.ports.receive(parts)

    def kv_import(self, ops: list[CacheOp], request_id: str, start: int, parts: list[LinkPart]) -> bool:
        """Replay `ops` (they reserve the room), then write the received `parts` after the request's KV."""
        replay(ops, self.runner.cache)
        return import_stage(self.runner.cache, self.ports, request_id, start, parts)

    def kv_close(self, prefix: str) -> None:
        """Forget the links whose ids start with `prefix`, and what arrived on them."""
        self.ports.close(prefix)

    def take_transfers(self) -> list[Transfer]:
        """The sends and receives timed since the last call, oldest first."""
        out = list(self.transfers)
        self.transfers.clear()
        return out

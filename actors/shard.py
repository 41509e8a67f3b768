"""One shard of a distributed instance: a ModelRunner over its layers only, its KV cache, and its p2p links.

A target pipeline stage holds a contiguous layer range (the first also embeds tokens, the last also has the
final norm and LM head); the draft shard holds the whole draft. Each step the shard replays the cache ops
its driver recorded (actors/kv_ledger.py), receives the previous stage's activations (unless first), runs
its layers, and sends the activations on (unless last) or returns the logits. The runner is the one the
single-process engine uses: parallelism is applied from outside it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from actors.kv_cache import KVExport
from actors.device import resolve_device
from actors.kv_ledger import CacheOp, replay
from actors.kv_links import KVPorts, LinkPart, import_stage, send_stage
from actors.model.loader import load_model
from actors.model.metadata import SeqChunk
from actors.model.quant import quantize_runner
from actors.model.runner import ModelRunner
from actors.moe import ep, shuffle
from actors.moe.permute import apply_plan
from actors.moe.profile import RoutingStats
from actors.p2p import P2P, Transfer
from actors.spec import draft_group, easyspec
from cluster.config import CacheConfig, DraftParallelConfig
from cluster.migration import Link
from placement.experts import ExpertPlan, contiguous_plan

MAX_TRANSFERS = 10_000  # transfer records a shard keeps for benchmarks


@dataclass(frozen=True)
class ShardSpec:
    """What one shard loads: layers `layer_ids` of checkpoint `source`; it embeds if `first`, has the head if `last`."""

    source: str
    dtype: str
    layer_ids: tuple[int, ...]
    first: bool
    last: bool
    cache: CacheConfig
    quantization: str = "none"  # "int8" / "int4": re-quantized at load (drafts only, see actors/model/quant.py)
    weights: str = "dequantized"  # engine.model.weights: how its linear maps compute (actors/model/weights.py)
    device: str = "auto"  # engine.model.device, resolved in the shard's process (actors/device.py)
    deterministic: bool = False  # engine.deterministic: the batch-invariant forward (actors/model/deterministic.py)
    # where the last stage hands its logits to the driver: they cross processes through Ray's object store,
    # which is host memory, so the driver (which holds no GPU) reads them from the CPU
    logits_device: str = "cpu"
    draft_parallel: DraftParallelConfig = DraftParallelConfig()  # a draft's EasySpec layer groups
    # an EasySpec group member other than the draft shard itself (rank 0): its rank, and the whole draft's layers
    # (its own `layer_ids` are the layers it runs; actors/spec/draft_group.py)
    group_rank: int = 0
    group_layers: tuple[int, ...] = ()
    # expert parallelism (actors/moe/ep.py): this rank of `ep_size`, all layers, a slice of each MoE layer's
    # experts, after reordering them by the ExpertPlan JSON `ep_plan` (None: contiguous)
    ep_rank: int = 0
    ep_size: int = 1
    ep_plan: str | None = None
    # "tensor": attention heads split over the ranks too, each token's FFN on the rank its experts are predicted
    # on from the routing statistics `ep_stats` where the prediction's confidence is >= `ep_confidence`
    # (actors/moe/shuffle.py); "data": whole requests per rank
    ep_attention: str = "data"
    ep_stats: str | None = None
    ep_confidence: float = 0.0

    @property
    def follower(self) -> bool:
        return self.group_rank > 0


def load_plan(spec: ShardSpec) -> ExpertPlan | None:
    """The expert plan an expert-parallel rank loads its experts by (None: contiguous)."""
    return ExpertPlan.model_validate_json(Path(spec.ep_plan).read_text()) if spec.ep_plan is not None else None


def load_shard(spec: ShardSpec, plan: ExpertPlan | None = None) -> ModelRunner:
    """Load the checkpoint, build the shard's runner, and drop every weight the shard does not run."""
    model = load_model(spec.source, spec.dtype, weights=spec.weights)  # on the CPU: the runner moves only its own layers to its device
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
    if not spec.follower:  # a follower walks rank 0's schedule (ShardWorker.step), it has none of its own
        easyspec.enable(runner, spec.draft_parallel)
    return runner


class ShardWorker:
    """A shard's data plane: replays cache ops, receives activations, runs its layers, sends them on or returns logits."""

    def __init__(self, spec: ShardSpec, threads: int = 1) -> None:
        torch.set_num_threads(threads)
        self.spec = spec
        self.plan = load_plan(spec)  # an expert-parallel rank's, read once: loading and online routing use it
        self.runner = load_shard(spec, self.plan)
        self.logits_device = torch.device(spec.logits_device)
        self.p2p: P2P | None = None
        self.owner: dict[int, int] = {}  # EasySpec: draft layer -> the group rank that runs it
        self.transfers: deque[Transfer] = deque(maxlen=MAX_TRANSFERS)
        self.ep_stats: ep.EPStats | None = None  # an expert-parallel rank's figures, from `join` on
        self.routing: ep.RoutingRecorder | None = None  # and its online routing statistics
        self.ports = KVPorts()  # its ends of migrations' links (actors/kv_links.py)

    # ---- setup ------------------------------------------------------------------------------
    def join(self, init_method: str, rank: int, world_size: int, timeout_s: float, backend: str | None = None) -> str:
        """Join the instance's process group as `rank` (the stage index) with `backend` (default: this stage's
        device's); returns the backend."""
        self.p2p = P2P(init_method, rank, world_size, timeout_s, self.runner.device, backend)
        if self.spec.draft_parallel.enabled:  # an EasySpec draft group: its members exchange over this group
            layers = self.spec.group_layers or self.spec.layer_ids
            self.owner = draft_group.group_owners(self.spec.draft_parallel, layers)
            if not self.spec.follower:
                assert self.runner.layer_parallel is not None
                self.runner.layer_parallel.members = draft_group.GroupMembers(self.owner, self.p2p)
        if self.spec.ep_size > 1:  # an expert-parallel rank: its MoE layers exchange tokens over this group
            comm = ep.DistComm(self.p2p.wire)
            if self.spec.ep_attention == "tensor":
                self.ep_stats = shuffle.enable(self.runner, comm, self._predictor(), self.spec.ep_confidence)
            else:
                self.ep_stats = ep.enable(self.runner, comm)
            self.routing = ep.RoutingRecorder(self.runner, self.plan)
        return self.p2p.backend

    def _predictor(self) -> shuffle.TokenPredictor | None:
        """A tensor-parallel rank's token predictor, from its routing statistics (None without)."""
        spec = self.spec
        if spec.ep_stats is None:
            return None
        stats = RoutingStats.load_file(Path(spec.ep_stats))
        plan = self.plan or contiguous_plan(stats.layers, stats.num_experts, spec.ep_size)
        return shuffle.TokenPredictor(stats, plan, self.runner.device)

    def device(self) -> str:
        """The device this shard computes on, e.g. "cpu" or "cuda:0"."""
        return str(self.runner.device)

    def backend(self) -> str | None:
        """The stages' process group backend ("gloo" or "nccl"); None until joined (a lone stage never joins)."""
        return self.p2p.backend if self.p2p is not None else None

    def num_parameters(self) -> int:
        """Parameters this shard holds (each shared tensor once)."""
        hf = self.runner.model.hf_model
        return sum(p.numel() for p in hf.parameters())

    def cache_usage(self, ops: list[CacheOp]) -> tuple[int, int]:
        """Replay `ops`, then (used, free) blocks of this shard's cache."""
        replay(ops, self.runner.cache)
        return self.runner.cache.num_used_blocks, self.runner.cache.num_free_blocks

    # ---- the step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, ops: list[CacheOp], chunks: list[SeqChunk], parallel: bool = False) -> torch.Tensor | None:
        """Replay `ops`, then run `chunks` through this stage: logits (sum num_logits, V) if last, else None."""
        replay(ops, self.runner.cache)
        if not chunks:
            return None
        if self.spec.follower:  # an EasySpec member: its layers' part of rank 0's forward
            cfg, layers = self.spec.draft_parallel, self.spec.group_layers
            schedule = easyspec.LayerParallel(len(layers), cfg.group_size, cfg.sequential_head, cfg.sequential_tail,
                                              cfg.mode)
            draft_group.follow(self.runner, schedule, layers, self.owner, self._p2p, chunks, parallel)
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

    @torch.inference_mode()
    def ep_step(self, ops: list[CacheOp], chunks: list[SeqChunk], active: bool
                ) -> tuple[torch.Tensor | None, ep.EPStats]:
        """An expert-parallel rank's step: replay `ops`, run its own requests' `chunks` through the whole model
        (logits (sum num_logits, V)); with none of its own while other ranks run (`active`), take part in
        every MoE layer's exchange with no tokens. Also returns the step's expert-parallel figures.

        Tensor-parallel attention: every rank runs every chunk; rank 0 returns the logits and counts the routing
        (its layers know every token's experts)."""
        replay(ops, self.runner.cache)
        out = None
        if chunks:
            logits = self.runner.forward(chunks)  # (sum num_logits, V)
            if self.spec.ep_attention == "data" or self.spec.ep_rank == 0:  # the others' logits are rank 0's
                out = logits.to(self.logits_device)
                if self.routing is not None:
                    self.routing.record(chunks)
        elif active:
            cfg = self.runner.model.config
            ep.idle(self.runner, cfg.hidden_size, self.runner.model.dtype)
        return out, self.take_ep_stats()

    def take_ep_stats(self) -> ep.EPStats:
        """The expert-parallel figures since the last call (each step's go back with it: ep_step)."""
        if self.ep_stats is None:
            raise RuntimeError("this shard is not an expert-parallel rank (or has not joined its group)")
        out, self.ep_stats = self.ep_stats, ep.EPStats()
        shuffle.set_stats(self.runner, self.ep_stats)
        return out

    def take_routing(self) -> RoutingStats:
        """The routing statistics of the tokens this rank ran since the last call (in the model's expert ids)."""
        if self.routing is None:
            raise RuntimeError("this shard is not an expert-parallel rank (or has not joined its group)")
        return self.routing.take()

    @property
    def _p2p(self) -> P2P:
        if self.p2p is None:
            raise RuntimeError("this stage has not joined its instance's process group")
        return self.p2p

    # ---- KV migration -----------------------------------------------------------------------
    def export(self, ops: list[CacheOp], request_id: str, start: int, end: int) -> KVExport:
        """Replay `ops`, then copy out KV of tokens [start, end) of a request for this shard's layers."""
        replay(ops, self.runner.cache)
        return self.runner.cache.export(request_id, start, end)

    def import_(self, ops: list[CacheOp], export: KVExport) -> bool:
        """Replay `ops` (they reserve the room), then write `export` (this shard's layers) after the request's KV."""
        replay(ops, self.runner.cache)
        return self.runner.cache.import_(export)

    # a migration's links (actors/kv_links.py): `kv_open`, `kv_receive` and `kv_close` run beside the steps (the
    # actor's "kv" concurrency group), `kv_send` and `kv_import` between them, like `export` and `import_`
    def kv_open(self, links: list[Link], side: str, timeout_s: float, backend: str) -> None:
        """Join `links` (this shard is their `side` end: "src" or "dst")."""
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

    # ---- benchmarks and teardown ------------------------------------------------------------
    def take_transfers(self) -> list[Transfer]:
        """The sends and receives timed since the last call, oldest first."""
        out = list(self.transfers)
        self.transfers.clear()
        return out

    def close(self) -> None:
        if self.p2p is not None:
            self.p2p.close()
            self.p2p = None
